"""What tbo cannot run inside SGLang fails the engine's start, naming the culprit: a bad key of
``TBO_SGLANG_CONFIG``, a model with nothing to overlap, and metrics asked for where SGLang serves none, each through a
real SGLang engine start (the scheduler process's traceback carries tbo's message; SGLang's own error only says that
the scheduler died). The config's
checks themselves run without SGLang in tests/test_sglang_config.py."""

from __future__ import annotations

import pytest

from .helpers import save_qwen3_dense, save_qwen3_moe, start_failure


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return save_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe") / "qwen3_moe")


def test_an_unknown_key_is_refused_by_name_at_engine_start(qwen3_moe):
    out = start_failure(qwen3_moe, {"num_microbatch": 3})
    assert "TboSglangError" in out and "unknown key 'num_microbatch'" in out, out[-3000:]
    assert "num_microbatches" in out  # the accepted keys are listed


def test_a_model_without_moe_layers_is_refused_at_load_naming_the_layer_and_feature(tmp_path):
    out = start_failure(save_qwen3_dense(tmp_path / "qwen3"), {})
    assert "TboSglangError" in out and "layer 0" in out and "no MoE layer" in out, out[-3000:]


def test_metrics_asked_for_by_name_without_sglang_s_metrics_is_refused(qwen3_moe):
    """``"metrics": true`` named on an engine without ``--enable-metrics``: its figures would go nowhere."""
    out = start_failure(qwen3_moe, {"metrics": True})
    assert "TboSglangError" in out and "metrics=True" in out and "--enable-metrics" in out, out[-3000:]
