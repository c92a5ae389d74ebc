import logging
import sys
import types

import pytest

import tbo
from tbo.util.optional import require, try_import


@pytest.fixture
def deep_gemm_standin(monkeypatch):
    """deep_gemm cannot be built here (CUDA only); this stand-in has its real SM-budget API: get/set_num_sms."""
    mod = types.ModuleType("deep_gemm")
    mod._n = 132
    mod.calls = []
    mod.get_num_sms = lambda: mod._n

    def set_num_sms(n):
        assert 0 < n <= 132, "deep_gemm asserts 0 < num_sms <= device SMs"
        mod.calls.append(n)
        mod._n = n

    mod.set_num_sms = set_num_sms
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    return mod


def test_sets_and_restores(deep_gemm_standin):
    with tbo.deep_gemm_num_sms(100):
        assert deep_gemm_standin.get_num_sms() == 100
    assert deep_gemm_standin.get_num_sms() == 132
    assert deep_gemm_standin.calls == [100, 132]


def test_restores_on_error(deep_gemm_standin):
    with pytest.raises(RuntimeError):
        with tbo.deep_gemm_num_sms(64):
            raise RuntimeError("forward failed")
    assert deep_gemm_standin.get_num_sms() == 132


def test_none_is_noop(deep_gemm_standin):
    with tbo.deep_gemm_num_sms(None):
        pass
    assert deep_gemm_standin.calls == []


def test_absent_deep_gemm_logs_and_noops(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import raises ModuleNotFoundError, installed or not
    assert try_import("deep_gemm") is None
    with caplog.at_level(logging.DEBUG, logger="tbo.comm.sm_budget"):
        with tbo.deep_gemm_num_sms(10):
            pass
    assert "deep_gemm is not installed" in caplog.text


def test_require_names_package_and_purpose():
    with pytest.raises(ImportError, match="DeepEP backend needs the optional package 'deep_ep'.*from source"):
        if try_import("deep_ep") is not None:
            pytest.skip("deep_ep is installed")
        require("deep_ep", "DeepEP backend")


def test_import_tbo_does_not_import_gpu_libraries():
    import subprocess

    code = "import sys, tbo, tbo.core.executors; print('deep_ep' in sys.modules, 'deep_gemm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
