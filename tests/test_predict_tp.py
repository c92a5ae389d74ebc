"""`tbo predict tp`: dense models under tensor parallelism, the all-reduce's algorithms and cut-off by hand, the
simulator on the all-reduce's piecewise cost, and the crossover scan."""

import re

import pytest

from tbo.tools.cli import main
from tbo.tools.predict.tensor_parallel import (DENSE_MODELS, TP_LINKS, DenseShape, TPLink, allreduce_seconds,
                                               get_dense_model, predict_tp)

LINK = TPLink(name="t", bandwidth=10e9, efficiency=0.5, step_latency_s=10e-6, one_shot_max_bytes={4: 1000.0})


def test_allreduce_algorithms_by_hand():
    rate = 5e9
    assert allreduce_seconds(999, 4, LINK) == (pytest.approx(10e-6 + 3 * 999 / rate), "one-shot")
    assert allreduce_seconds(1000, 4, LINK) == (pytest.approx(20e-6 + 1.5 * 1000 / rate), "two-shot")
    assert allreduce_seconds(10**9, 2, LINK)[1] == "one-shot"  # two ranks: one-shot at any size (no cut-off given)
    assert allreduce_seconds(10, 8, LINK)[1] == "two-shot"  # no cut-off for 8 ranks: two-shot only
    assert allreduce_seconds(123, 1, LINK) == (0.0, "none")
    nv = TP_LINKS["nvlink"]
    assert [allreduce_seconds(n, 4, nv)[1] for n in (512 * 1024 - 1, 512 * 1024)] == ["one-shot", "two-shot"]
    assert [allreduce_seconds(n, 8, nv)[1] for n in (256 * 1024 - 1, 256 * 1024)] == ["one-shot", "two-shot"]


def test_simulated_transfer_is_the_allreduce_on_both_sides_of_the_cut_off():
    p = predict_tp("l40s", "llama-3.1-8b", tp=4, link="pcie4")
    per_token = 4096 * 2  # BF16 rows of hidden 4096: the cut-off (512 KiB) falls between 63 and 64 tokens
    for tokens in (1, 17, 63, 64, 65, 300, 5000):
        want = allreduce_seconds(tokens * per_token, 4, p.link)
        assert p.costs.transfer("mlp_reduce", tokens)[1] == pytest.approx(want[0], rel=1e-12)
        assert p.allreduce(tokens) == want
    assert (p.allreduce(63)[1], p.allreduce(64)[1]) == ("one-shot", "two-shot")


def test_layer_extrapolation_equals_the_whole_simulation():
    p = predict_tp("h100", "llama-3.1-8b", tp=2, mode="prefill", context=512)
    for tokens in (7, 256, 1000):
        single, tbo = p.steps(tokens)
        c = p.compare(tokens)
        assert single == pytest.approx(c.single.step_s, rel=1e-9) and tbo == pytest.approx(c.tbo.step_s, rel=1e-9)


def test_the_trap_and_the_crossover():
    """Halves under the one-shot cut-off cost more link time than the whole: the same step splits worse with the
    cut-off than without it, and splitting pays only above a crossover."""
    trapped = predict_tp("l40s", "llama-3.1-8b", tp=4, link="pcie4")
    free = predict_tp("l40s", "llama-3.1-8b", tp=4, link=trapped.link.model_copy(update={"one_shot_max_bytes": {}}))
    assert trapped.allreduce(64)[1] == "two-shot" and trapped.allreduce(32)[1] == "one-shot"
    assert trapped.speedup(64) < free.speedup(64)
    assert trapped.speedup(16) < 1 < trapped.speedup(1024)  # decode: the split reads every weight twice
    cross = trapped.crossover(range(2, 1025, 2))
    assert cross is not None and trapped.speedup(cross) > 1 >= trapped.speedup(cross - 2)


def test_shapes_and_refusals(tmp_path):
    assert get_dense_model("Qwen3-32B") is DENSE_MODELS["qwen3-32b"]
    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96}')
    shape = get_dense_model(str(tmp_path))
    assert isinstance(shape, DenseShape) and (shape.num_kv_heads, shape.head_dim) == (4, 16)
    with pytest.raises(ValueError, match="unknown dense model 'gpt'"):
        get_dense_model("gpt")
    with pytest.raises(ValueError, match="tp=1"):
        predict_tp("h100", "qwen3-32b", tp=1)
    with pytest.raises(ValueError, match="TP 3: num_heads=32, intermediate=14336 not divisible by 3"):
        predict_tp("h100", "llama-3.1-8b", tp=3)


def test_cli_lines(capsys):
    assert main(["predict", "tp", "--hardware", "l40s", "--model", "llama-3.1-8b", "--tp", "4", "--link", "pcie4",
                 "--tokens", "64", "--max-tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^speedup: 0\.\d{4}$", out, re.M)
    assert re.search(r"^allreduce_us: whole [\d.]+ \(two-shot\), half [\d.]+ \(one-shot\)$", out, re.M)
    assert "RFC vllm#56126's trap" in out and re.search(r"^crossover_tokens: \d+$", out, re.M)


def test_lint_and_simulator_know_the_reductions(capsys):
    """The reduce ops are transfers to the linter (paired, overlapped: no finding) and to the simulator (booked on
    the link, hidden by the other microbatch's compute)."""
    import tbo.strategies as S
    from tbo.core.strategy import OperationsStrategy
    from tbo.tools.lint import lint
    from tbo.tools.simulate import Cost, CostModel, TransferCost, simulate, summary

    for name in ("dense_tp_decode", "dense_tp_prefill", "moe_tp_decode", "moe_tp_prefill"):
        assert lint(S.get(name), 2, layers=3) == [], name
        assert main(["lint", name]) == 0
    swapped = OperationsStrategy(operations=["attn_reduce_b", "attn_reduce_a"], fragment=True)
    assert {f.code for f in lint(swapped, 2)} == {"wait-without-launch"}
    costs = CostModel(ops={"attn_core": Cost(kind="constant", seconds=1.0), "mlp": Cost(kind="constant", seconds=1.0)},
                      transfers={k: TransferCost(bytes_fixed=1.0) for k in ("attn_reduce", "mlp_reduce")},
                      bandwidth=1.0)  # every reduction takes 1 s of link, as long as each compute op
    whole = OperationsStrategy.concat([S.get("dense_tp_decode")] * 2)
    one = summary(simulate(whole, costs, [1], 0).trace)
    two = summary(simulate(whole, costs, [1, 1]).trace)
    assert one.exposed_s == pytest.approx(4.0)  # unsplit: every reduction waited for in full
    assert two.exposed_s == pytest.approx(1.0)  # split: only the last microbatch's last one (the drain)
