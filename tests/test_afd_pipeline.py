"""`tbo.tools.afd_pipeline`: AFD at N microbatches over a link with latency, which count pays and why (issue 50).

Every figure is the event model's, from constant or linear costs, so the oracles are closed forms: no clock."""

from __future__ import annotations

import json

import pytest

from tbo.split.adaptive import UNSPLIT, AdaptiveSplit, Choice
from tbo.tools.afd_pipeline import AFDCosts, choose_count, estimate, parse_counts, simulate_afd
from tbo.tools.cli import main
from tbo.tools.simulate import Cost

#: balanced sides (the FFN a little cheaper per token, dearer per call: it reads the experts' weights), 8 layers,
#: the hidden states of a 2048-byte token each way over 10 GB/s; ``latency_s`` is the regime
BALANCED = dict(attention=Cost(seconds=1e-4, per_token=4e-6), ffn=Cost(seconds=2e-4, per_token=3e-6), num_layers=8,
                bytes_per_token=2048, bandwidth=1e10)


def costs(latency_s: float, **over) -> AFDCosts:
    return AFDCosts(**{**BALANCED, "latency_s": latency_s, **over})


def test_unsplit_is_the_sum_of_its_round_trips():
    c = AFDCosts(attention=Cost(kind="constant", seconds=3.0), ffn=Cost(kind="constant", seconds=2.0), num_layers=4,
                 latency_s=0.5)
    run = simulate_afd(c, [64])
    assert run.step_s == 4 * (3.0 + 0.5 + 2.0 + 0.5) and run.attention_idle_s == 4 * 3.0


@pytest.mark.parametrize("m, latency, covered", [(2, 1.5, False), (3, 1.5, True), (3, 3.0, False), (4, 3.0, True)])
def test_the_ping_pong_condition_is_what_the_replay_shows(m, latency, covered):
    """With stage A = 3, FFN F = 1 and link latency l each way, a microbatch's round trip is 2l + F; where
    (m - 1) x A covers it the attention side runs back to back after the first stage and the step is L x m x A plus
    the last microbatch's round trip; where it does not, the attention side idles the difference every layer."""
    c = AFDCosts(attention=Cost(kind="constant", seconds=3.0), ffn=Cost(kind="constant", seconds=1.0), num_layers=5,
                 latency_s=latency)
    choice = choose_count(c, 64, (m,))
    row = choice.count(m)
    assert row.round_trip_s == 2 * latency + 1.0 and row.covered is covered
    if covered:
        assert row.run.step_s == 5 * m * 3.0 + 2 * latency + 1.0
    else:
        gap = row.round_trip_s - (m - 1) * 3.0
        assert row.run.step_s == pytest.approx(5 * m * 3.0 + 4 * gap + 2 * latency + 1.0)


def test_the_best_count_changes_from_two_to_three_as_latency_grows():
    """No latency: two microbatches hide the FFN and a third only fragments; a round trip near a stage's compute:
    two leave the attention side idle, three fill the gap."""
    best = {lat: choose_count(costs(lat), 256, (2, 3)).best for lat in (0.0, 5e-5, 1e-4, 3e-4, 5e-4)}
    assert best[0.0] == 2 and best[1e-4] == 3 and best[5e-4] == 3, best
    low, high = choose_count(costs(0.0), 256, (2, 3)), choose_count(costs(3e-4), 256, (2, 3))
    assert "3 fragment more than they hide" in low.reason
    assert "2 leave the attention side idle" in high.reason and "round trip" in high.reason
    assert high.count(3).speedup > 1.1 * high.count(2).speedup


def test_a_count_that_gains_too_little_gives_way_to_fewer():
    c = AFDCosts(attention=Cost(kind="linear", per_token=1e-5), ffn=Cost(kind="linear", per_token=1e-6),
                 num_layers=8)
    choice = choose_count(c, 240, (2, 3, 4))  # more microbatches shorten only the fill and the drain: ~1% each
    assert choice.count(4).run.step_s < choice.count(2).run.step_s * 1.01 and choice.best == 2
    assert "gain less than 1% more" in choice.reason


def test_splitting_that_cannot_pay_says_so():
    c = AFDCosts(attention=Cost(kind="constant", seconds=1.0), ffn=Cost(kind="constant", seconds=1.0))
    choice = choose_count(c, 64)
    assert choice.best == 1 and "run unsplit" in choice.reason
    assert choose_count(c, 1).best == 1 and "too few to split" in choose_count(c, 1).reason


def test_the_estimate_is_the_adaptive_splits_prior():
    """The replay as `AdaptiveSplit`'s estimate: each bucket starts on the count the simulator picks, and, run on
    the replayed costs, never leaves it (the prior and the measurements agree)."""
    for latency, best in ((0.0, 2), (3e-4, 3)):
        c = costs(latency)
        two, three = Choice("afd_attention", 2), Choice("afd_attention", 3)
        policy = AdaptiveSplit({"decode": [two, three]}, estimate=estimate(c, "afd_attention", (2, 3)))
        chosen = []
        for _ in range(60):
            pick = policy.choose("decode", 256)
            tokens = [256] if not pick.split else [256 * (i + 1) // pick.num_microbatches - 256 * i //
                                                   pick.num_microbatches for i in range(pick.num_microbatches)]
            policy.observe("decode", 256, pick, simulate_afd(c, tokens).step_s)
            chosen.append(pick)
        assert choose_count(c, 384, (2, 3)).best == best  # the bucket's middle, where the estimate is taken
        assert chosen[0].num_microbatches == best and chosen[-1].num_microbatches == best
        assert chosen.count(UNSPLIT) <= 1  # the one reference sample, at most


def test_the_cli_names_the_count_and_why(tmp_path, capsys):
    path = tmp_path / "afd.json"
    for latency, best in ((0.0, 2), (3e-4, 3)):
        path.write_text(json.dumps(costs(latency).model_dump()))
        assert main(["simulate", "--afd", str(path), "--tokens", "256", "--microbatches", "2,3"]) == 0
        out = capsys.readouterr().out
        assert f"best_microbatches: {best}\n" in out and f"best count: {best} (" in out
        assert "2 microbatches: " in out and "vs (m-1) x attention stage" in out and "8 layers" in out
    assert main(["simulate", "--afd", str(path), "--tokens", "256", "--layers", "2"]) == 0
    assert "AFD, 2 layers" in capsys.readouterr().out
    assert main(["simulate", "--afd", str(path), "--tokens", "256", "--microbatches", "1,3"]) == 2
    assert "microbatch counts must each be 2..64, got '1,3'" in capsys.readouterr().err
    assert main(["simulate", "--tokens", "256"]) == 2
    assert "needs a STRATEGY and --costs" in capsys.readouterr().err
    path.write_text(json.dumps({**costs(0.0).model_dump(), "latency_s": -1}))
    assert main(["simulate", "--afd", str(path), "--tokens", "256"]) == 2
    assert "latency_s" in capsys.readouterr().err


def test_predict_afd_picks_more_microbatches_over_a_slower_link(capsys):
    """DeepSeek-V3 on H800 at 128 tokens per attention GPU: two microbatches over a 0-latency link, three once the
    latency approaches an attention stage's compute."""
    best = {}
    for link in ("0,50", "100,50"):
        assert main(["predict", "afd", "--hardware", "h800", "--model", "deepseek-v3", "--ep", "32",
                     "--tokens-per-device", "128", "--context", "4096", "--kv-bytes", "1", "--link", link]) == 0
        out = capsys.readouterr().out
        best[link] = int(out.split("best_microbatches: ")[1].split()[0])
        assert "per layer unsplit: attention" in out and "best count: " in out
    assert best == {"0,50": 2, "100,50": 3}
    assert parse_counts("2,3,4") == (2, 3, 4)
    with pytest.raises(ValueError, match="integers separated by commas"):
        parse_counts("2;3")
