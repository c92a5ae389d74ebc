"""The linter, fault handling (drain after a failure, over real gloo), and the hang watchdog."""

import re
import threading

import pytest
import torch

import tbo.strategies as S
from tbo import HangError, OperationError, OperationsStrategy, Yield, lint
from tbo.core.inflight import InFlightLimit
from tbo.tools.cli import main
from tbo.comm import LocalBackend, TorchDistributedBackend
from tbo.harness.launch import launch
from tbo.models import AttentionMetadata, KVCache, ModelConfig, ReferenceModel
from tbo.split import ForwardMode, SplitPolicy


# ---- linter -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", S.names())
def test_builtin_strategies_have_no_errors(name):
    joined = OperationsStrategy.concat([S.get(name)] * 3)
    errors = [f for f in lint(joined, 2) if f.level == "error"]
    ll = [f for f in lint(joined, 2, low_latency=True) if f.level == "error"]
    assert errors == []
    # over DeepEP low-latency (one un-received call at a time) only the decode shapes, with their lead of two, fit;
    # prefill (delta 0) launches B's dispatch while A's is in flight, and lint says so; the tensor-parallel lists
    # dispatch nothing over the network (their all-reduces are not DeepEP's)
    if name.endswith("_decode") or name.startswith("afd") or "dispatch_a" not in S.get(name).operations:
        assert ll == []
    else:
        assert ll and {f.code for f in ll} == {"too-many-in-flight"}
        assert any(f.message.startswith("microbatch 1's 'dispatch_a'") and "while microbatch 0's 'dispatch_a'" in
                   f.message for f in ll)


def codes(ops, delta=0, low_latency=False, microbatches=2):
    strategy = OperationsStrategy(operations=ops, delta_stages=delta, fragment=True)  # lint sees what build refuses
    return [(f.level, f.code) for f in lint(strategy, microbatches, low_latency)]


def test_lint_errors():
    assert codes(["attn", Yield, "dispatch_b"]) == [("error", "wait-without-launch")]  # once, not per microbatch
    assert codes(["attn", "dispatch_a", Yield, "mlp"]) == [("error", "never-waited")]
    findings = lint(OperationsStrategy(operations=["attn", "dispatch_a", Yield, "mlp", Yield, "dispatch_b"]), 2,
                    low_latency=False)
    assert not [f for f in findings if f.level == "error"]
    # the second microbatch launches before the first's dispatch is received: DeepEP low-latency tolerates one
    ll = codes(["attn", "dispatch_a", Yield, "mlp", Yield, "dispatch_b"], low_latency=True, microbatches=2)
    assert ("error", "too-many-in-flight") in ll
    # a limit of two (a backend of your own) lets two microbatches run, not three
    two = InFlightLimit(2, backend="a two-slot link")
    spread = OperationsStrategy(operations=["attn", "dispatch_a", Yield, "mlp", Yield, "dispatch_b"])
    assert not lint(spread, 2, backend=two)
    three = [f for f in lint(spread, 3, backend=two) if f.code == "too-many-in-flight"]
    assert [(f.microbatch, f.stage, f.op) for f in three] == [(2, 0, "dispatch_a")]
    assert "that makes 3 transfers in flight, and a two-slot link tolerates at most 2" in three[0].message
    fragment = OperationsStrategy(operations=["attn", Yield, "dispatch_b"], fragment=True)
    err = next(f for f in lint(fragment) if f.level == "error")
    assert (err.microbatch, err.stage, err.op) == (0, 1, "dispatch_b") and "no earlier op launches" in err.message
    swapped = lint(OperationsStrategy(operations=["attn", "dispatch_b", Yield, "dispatch_a", "mlp"], fragment=True))
    assert [(f.code, f.op) for f in swapped] == [("wait-without-launch", "dispatch_b")]  # one bug, one error
    assert "before operations[3] 'dispatch_a' (stage 1) launches it" in swapped[0].message


def test_lint_warnings():
    assert ("warning", "same-stage") in codes(["attn", "dispatch_a", "dispatch_b", "mlp"])
    # launch, Yield, wait with nothing in between in either microbatch (delta 0: B's stage is also empty of compute)
    assert ("warning", "no-overlap") in codes(["attn", "dispatch_a", Yield, "dispatch_b", "mlp"], delta=0,
                                              microbatches=1)
    assert codes(["attn", "dispatch_a", Yield, "mlp", "dispatch_b"]) == []


def test_lint_places_findings_in_the_users_strategy(capsys):
    """Linting 3 joined layers spoke of the joined run ("stage 9" of a 6-stage strategy, "operations[8]" of a 5-item
    list). Every finding now names the user's layer, stage and operations index, and the joined run's stage."""
    ops = ["attn", "dispatch_a", Yield, "dispatch_b", "mlp"]  # nothing between the launch and its wait
    layer = OperationsStrategy(operations=ops, name="mine")
    found = lint(layer, 1, layers=3)
    assert [(f.code, f.layer, f.stage, f.index, f.op, f.run_stage) for f in found] == [
        ("no-overlap", n, 1, 3, "dispatch_b", n + 1) for n in range(3)]
    assert str(found[2]).startswith("warning: no-overlap: microbatch 0, layer 2, stage 1, operations[3] 'dispatch_b' "
                                    "(stage 3 of the joined layers): no compute runs")
    assert all(f.layer is None and f.run_stage is None for f in lint(layer, 1))  # one layer: nothing to place
    prefill = S.get("deepseek_prefill")
    errors = lint(prefill, 2, low_latency=True, layers=3)
    assert errors and all(f.code == "too-many-in-flight" for f in errors)
    assert {f.layer for f in errors} == {0, 1, 2} and max(f.run_stage for f in errors) >= prefill.num_stages
    for f in errors:
        assert f.stage < prefill.num_stages and f.index < len(prefill.operations)
        assert prefill.operations[f.index] == f.op and f"'{f.op}' (layer {f.layer}, stage {f.stage}, " in f.message
    assert main(["lint", "deepseek_prefill", "--low-latency", "--layers", "3"]) == 1
    out = capsys.readouterr().out
    assert not re.search(r"stage ([3-9]|\d\d), operations", out) and "(stage 4 of the joined layers)" in out


def test_in_flight_message_reads_as_over_the_limit():
    """"1 transfer in flight, and DeepEP low-latency tolerates 1" read as allowed."""
    msg = next(f for f in lint(S.get("deepseek_prefill"), 2, low_latency=True)).message
    assert "that makes 2 transfers in flight, and DeepEP low-latency tolerates at most 1" in msg


def test_the_pipelines_drain_is_not_a_warning():
    """Every built-in strategy carried a no-overlap warning for the last microbatch's last combine, which no strategy
    can fix: the other microbatches have finished. That drain is not reported; the same gap elsewhere still is."""
    for name in S.names():
        assert not [f for f in lint(S.get(name), 2, layers=3) if f.code == "no-overlap"], name
    alone = lint(S.get("deepseek_decode"), 1, layers=2)  # one microbatch: nothing else ever overlaps
    assert {f.code for f in alone} == {"no-overlap"} and "move compute between them" in alone[0].message


def test_lint_cli_exit_codes(tmp_path, capsys):
    assert main(["lint", "deepseek_decode", "--low-latency"]) == 0
    assert main(["lint", "deepseek_decode", "--backend", "deepep_low_latency", "--microbatches", "3"]) == 1
    out = capsys.readouterr().out
    assert "too-many-in-flight" in out and "over DeepEP low-latency" in out and "DeepEP issue #513" in out
    assert main(["lint", "deepseek_prefill", "--max-in-flight", "2"]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(OperationsStrategy(operations=["attn", Yield, "combine_b"], fragment=True).model_dump_json())
    assert main(["lint", str(bad)]) == 1  # a file the constructor refuses is linted, not a load error
    assert "wait-without-launch" in capsys.readouterr().out
    swapped = tmp_path / "swapped.json"
    swapped.write_text('{"operations": ["attn", "dispatch_b", "Yield", "dispatch_a", "mlp"]}')
    assert main(["lint", str(swapped)]) == 1
    assert "before operations[3] 'dispatch_a'" in capsys.readouterr().out
    assert main(["show", str(swapped)]) == 2  # elsewhere it is refused with the same message
    assert "before operations[3] 'dispatch_a'" in capsys.readouterr().err


# ---- fault handling over gloo ----------------------------------------------------------------------------------------
def _fail_while_a_dispatch_in_flight(rank, world):
    config = ModelConfig.deepseek_v3_tiny(num_layers=3)
    backend = TorchDistributedBackend(config.num_experts, timeout_s=20)
    model = ReferenceModel(config, backend)
    armed = {"on": True}
    layer = model.layers[2]  # a MoE layer: when B prepares its attention, A's dispatch of layer 1 is in flight
    original = layer.op_attn_prepare

    def failing_attn_prepare(state):
        if armed["on"] and state.microbatch_idx == 1:
            raise RuntimeError("injected failure in microbatch B")
        return original(state)

    layer.op_attn_prepare = failing_attn_prepare
    lens = [3, 5, 2, 4]
    ids = torch.arange(sum(lens)) % config.vocab_size + rank
    meta = AttentionMetadata.build(range(4), lens, [0] * 4)
    plan = SplitPolicy(prefill_token_threshold=2).plan(ForwardMode.EXTEND, sum(lens), lens)
    in_flight_seen = []
    real_attn_prepare = failing_attn_prepare

    def spy(state):
        in_flight_seen.append(len(backend.in_flight))
        return real_attn_prepare(state)

    layer.op_attn_prepare = spy
    try:
        model.forward_tbo(ids, meta, KVCache(), "deepseek_decode", plan)
        error = None
    except OperationError as exc:
        error = (exc.microbatch, exc.op_name, str(exc.__cause__))
    left = len(backend.in_flight)
    armed["on"] = False
    again = model.forward_tbo(ids, meta, KVCache(), "deepseek_decode", plan)
    reference = model.forward(ids, meta, KVCache())
    return error, max(in_flight_seen), left, torch.equal(again, reference)


@pytest.mark.dist
def test_failure_drains_and_next_step_runs():
    for error, in_flight_at_failure, left, next_step_ok in launch(_fail_while_a_dispatch_in_flight, 2):
        assert error == (1, "spy", "injected failure in microbatch B")
        assert in_flight_at_failure >= 1  # A's dispatch was really in flight when B failed
        assert left == 0  # drained before the error surfaced
        assert next_step_ok  # same process group and backend, next step bit-exact


# ---- watchdog ---------------------------------------------------------------------------------------------------------
class NeverCompletes(LocalBackend):
    """A transport that launches and never delivers: dispatch_b waits forever (blocked in C, or polling)."""

    def __init__(self, num_experts, polling=False):
        super().__init__(num_experts)
        self.stuck, self.polling = threading.Event(), polling

    @property
    def in_flight(self):
        return ["dispatch (never completes)"]

    def dispatch_b(self, state):
        if self.polling:
            while not self.stuck.wait(0.05):  # the way a transport waits in slices, checking a deadline
                pass
        self.stuck.wait()  # forever, unless something interrupts it
        return super().dispatch_b(state)


def _hang_step(watchdog_s, dump_stacks=False, polling=False):
    config = ModelConfig.qwen3_moe_tiny(num_layers=2)
    model = ReferenceModel(config, NeverCompletes(config.num_experts, polling))
    meta = AttentionMetadata.build(range(4), [1] * 4, [0] * 4)
    plan = SplitPolicy().plan(ForwardMode.DECODE, 4)
    return model.forward_tbo(torch.arange(4), meta, KVCache(), "qwen3_moe_decode", plan, watchdog_s=watchdog_s,
                             watchdog_label="rank 0", dump_stacks=dump_stacks)


def test_watchdog_raises_hang_error_with_positions():
    with pytest.raises(HangError) as info:  # the 1 s watchdog is the deadline under test: its message says it fired
        _hang_step(1.0)
    text = str(info.value)
    assert text.startswith("rank 0: the step ran past its 1s watchdog")
    assert "microbatch 0: stage 3, in op 'dispatch_b'" in text
    assert "microbatch 1: stage 0 done" in text  # B is two stages behind (delta 2): next comes its stage 1
    assert "transfers pending: dispatch (never completes)" in text


def test_watchdog_dumps_stacks_and_works_off_the_main_thread():
    result = {}

    def run():
        try:
            _hang_step(1.0, dump_stacks=True, polling=True)
        except HangError as exc:
            result["text"] = str(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)  # off the main thread the error lands when the thread next runs Python: the polling wait does
    assert not thread.is_alive()
    assert "the step ran past its 1s watchdog" in result["text"]
    assert "thread stacks" in result["text"] and "File" in result["text"]


def test_watchdog_off_costs_nothing_and_passes_through():
    config = ModelConfig.qwen3_moe_tiny(num_layers=2)
    model = ReferenceModel(config)
    meta = AttentionMetadata.build(range(4), [1] * 4, [0] * 4)
    plan = SplitPolicy().plan(ForwardMode.DECODE, 4)
    a = model.forward_tbo(torch.arange(4), meta, KVCache(), "qwen3_moe_decode", plan, watchdog_s=30)
    b = model.forward(torch.arange(4), meta, KVCache())
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="watchdog_s must be positive"):
        model.forward_tbo(torch.arange(4), meta, KVCache(), "qwen3_moe_decode", plan, watchdog_s=0)


# ---- after a timeout: refuse, do not pair stale operations; one deadline for the drain (issue 35) -----------------
def _time_out_then_step_again(rank, world):
    import time

    from tbo.comm.transport import TorchDistributedTransport
    from tbo.core.errors import CommTimeoutError

    transport = TorchDistributedTransport(timeout_s=1.0)
    if rank == 1:
        time.sleep(6)  # stopped past the peer's deadline, then resumed: its operations come late
        return None
    pending = [transport.start(torch.ones(4, 2), [2, 2], [2, 2], f"dispatch {i}") for i in range(3)]
    try:
        transport.finish(pending[0])
        first = None
    except CommTimeoutError as e:
        first = str(e)
    t0 = time.monotonic()
    drained = transport.drain()
    drain_s = time.monotonic() - t0
    try:
        transport.exchange(torch.ones(2), "count exchange")
        again = None
    except CommTimeoutError as e:
        again = str(e)
    return first, drained, drain_s, again, transport.poisoned is not None


@pytest.mark.dist
def test_after_a_timeout_the_transport_refuses_the_next_step_and_drains_within_one_deadline():
    first, drained, drain_s, again, poisoned = launch(_time_out_then_step_again, 2, timeout_s=120)[0]
    assert first and "dispatch 0 timed out after 1s" in first
    assert drained == 2 and poisoned
    # one shared deadline of 0.2 x timeout_s for both (it used to be timeout_s each): a bound, not a timing
    assert drain_s < 1.0, drain_s
    assert again and "count exchange refused: an earlier wait timed out" in again and "rebuild the group" in again
