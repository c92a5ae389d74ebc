"""The vLLM version gate (`tbo.integrations.vllm.admit.checks.check_vllm_version`), a pure function: vLLM 0.32, 0.33
and 0.34 admitted, each with the model runners it has (`tbo.integrations.vllm.contract.RUNNERS`), every other
version refused by name with the supported range. No vLLM needed."""

from __future__ import annotations

import re

import pytest

from tbo.integrations.vllm.admit.checks import SUPPORTED_VLLM, check_vllm_version
from tbo.integrations.vllm.contract import ALL, RUNNERS, V1
from tbo.integrations.vllm.errors import TboConfigError


@pytest.mark.parametrize("version,runners", [
    ("0.32.0", ("v1", "v2")), ("0.32.3", ("v1", "v2")), ("0.33.0", ("v1", "v2")), ("0.33.1rc2", ("v1", "v2")),
    ("0.34.0", ("v2",)), ("0.34.2+cpu", ("v2",))])
def test_admitted_releases_and_their_runners(version, runners):
    assert check_vllm_version(version) == runners
    for runner in runners:
        assert check_vllm_version(version, runner) == runners


@pytest.mark.parametrize("version", ["0.31.2", "0.31.99", "0.35.0", "0.3.2", "1.0.0", "0.320.0"])
def test_other_versions_are_refused_by_name_with_the_range(version):
    with pytest.raises(TboConfigError) as e:
        check_vllm_version(version)
    message = str(e.value)
    assert f"but {version} is installed" in message
    assert ">=0.32.0,<0.35" in message and "0.32 (V1, V2), 0.33 (V1, V2), 0.34 (V2)" in message
    with pytest.raises(TboConfigError, match=re.escape(version)):  # whatever runner is asked for
        check_vllm_version(version, "v2")


def test_a_runner_the_release_lacks_is_refused_by_name():
    with pytest.raises(TboConfigError, match=r"vLLM 0\.34\.0 has no V1 model runner \(it has V2 \(Model Runner V2\)\)"):
        check_vllm_version("0.34.0", "v1")
    with pytest.raises(ValueError, match="'v3'"):
        check_vllm_version("0.34.0", "v3")


def test_a_source_build_is_let_through():
    assert check_vllm_version("dev") == ("v1", "v2")


def test_the_range_and_the_table_agree():
    """`SUPPORTED_VLLM` says in words what `RUNNERS` lists: the first release up to the one after the last."""
    first, last = ALL[0], ALL[-1]
    major, minor = last.split(".")
    assert SUPPORTED_VLLM == f">={first}.0,<{major}.{int(minor) + 1}"
    assert [int(r.split(".")[1]) for r in ALL] == list(range(int(first.split(".")[1]), int(minor) + 1))  # no gaps
    assert V1 == ("0.32", "0.33") and RUNNERS["0.34"] == ("v2",)
