"""`GraphRunner`: bucket choice, padding, the plan per bucket and the eager fallback on a CPU (`EagerCapturer` replays
by re-running the step on the static buffers); capture and replay with CUDA graphs on a GPU."""

import pytest
import torch

from tbo.runtime.cuda_graph import EagerCapturer, GraphRunner
from tbo.split import SplitPolicy, merge_outputs, split_inputs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Step:
    """A step that splits by its plan like a model does, and remembers what it was called with."""

    def __init__(self):
        self.calls = []

    def __call__(self, inputs, plan):
        self.calls.append((inputs["x"].shape[0], plan, inputs["slot"].clone()))
        if plan is None:
            return {"y": inputs["x"] * 2 + inputs["slot"].unsqueeze(1)}
        parts = split_inputs(inputs, plan)
        outs = [p["x"] * 2 + p["slot"].unsqueeze(1) + 0 * k for k, p in enumerate(parts)]
        return {"y": merge_outputs(outs, plan)}


def batch(n, width=3):
    return {"x": torch.arange(n * width, dtype=torch.float32).view(n, width), "slot": torch.arange(n) + 100}


def test_bucket_choice_and_plan_per_bucket():
    runner = GraphRunner(Step(), [8, 2, 32, 8], policy=SplitPolicy(decode_token_threshold=4), capture=False)
    assert runner.batch_sizes == [2, 8, 32]
    assert [runner.bucket_for(n) for n in (1, 2, 3, 8, 9, 32, 33)] == [2, 2, 8, 8, 32, 32, None]
    assert runner.plan_for(2) is None  # below the policy's threshold: the bucket runs single even for TBO
    plan = runner.plan_for(8)
    assert [mb.requests_len for mb in plan.microbatches] == [4, 4]
    assert [mb.requests_len for mb in runner.plan_for(32).microbatches] == [16, 16]


def test_pad_uses_pad_values_per_key():
    runner = GraphRunner(Step(), [8], pad_values={"slot": 7}, capture=False)
    padded = runner.pad(batch(3), 8)
    assert padded["slot"].tolist() == [100, 101, 102, 7, 7, 7, 7, 7]
    assert padded["x"][3:].eq(0).all() and torch.equal(padded["x"][:3], batch(3)["x"])


def test_capture_false_always_eager_unpadded_with_the_real_plan():
    step = Step()
    runner = GraphRunner(step, [8], capture=False)
    out = runner.run(batch(5))
    assert runner.last.how == "eager" and runner.last.reason == "capture=False"
    assert step.calls[-1][0] == 5 and [mb.requests_len for mb in step.calls[-1][1].microbatches] == [2, 3]
    assert torch.equal(out["y"], Step()(batch(5), None)["y"])


@pytest.mark.parametrize("tbo", [False, True])
def test_replay_equals_eager_for_every_bucket_including_padded(tbo):
    step = Step()
    capturer = EagerCapturer()
    runner = GraphRunner(step, [2, 4, 8], policy=SplitPolicy(decode_token_threshold=4), pad_values={"slot": -1},
                         capturer=capturer)
    runner.capture_all(batch(1))
    assert capturer.captures == 3 + 2  # single per bucket, TBO for 4 and 8 (2 requests do not split)
    for n in range(1, 9):
        out = runner.run(batch(n), tbo=tbo)
        assert runner.last.how == "graph" and runner.last.bucket == runner.bucket_for(n)
        n_calls, plan, slots = step.calls[-1]
        assert n_calls == runner.last.bucket  # the step ran on the whole static bucket
        assert (plan is None) == (not tbo or runner.last.bucket == 2)
        assert slots[n:].eq(-1).all()  # padding rows carry the pad value
        assert torch.equal(out["y"], Step()(batch(n), None)["y"])  # sliced back to the real batch
    assert capturer.captures == 5  # nothing was captured twice


def test_static_buffers_are_reused_and_outputs_cloned():
    runner = GraphRunner(Step(), [4], capturer=EagerCapturer())
    first = runner.run(batch(3))
    static_in = runner._static[4]["x"]
    second = runner.run({"x": batch(3)["x"] + 1, "slot": batch(3)["slot"]})
    assert runner._static[4]["x"] is static_in  # fixed addresses, as a graph needs
    assert not torch.equal(first["y"], second["y"])  # the first result was a copy, not a view of the outputs
    views = GraphRunner(Step(), [4], capturer=EagerCapturer(), clone_outputs=False)
    a = views.run(batch(4))
    views.run({"x": batch(4)["x"] * 0, "slot": batch(4)["slot"]})
    assert torch.equal(a["y"], batch(4)["slot"].unsqueeze(1).float().expand(4, 3))  # a view: overwritten


def test_a_lazy_capture_warms_up_on_padding_not_on_the_last_request():
    """Issue 22, defect 4: a bucket's single and TBO graphs share its static buffers. The mode captured second (lazily,
    on its first run) must warm up and capture on pad values, not on the previous request's slots, which a real
    step would write again (live KV entries)."""
    step = Step()
    capturer = EagerCapturer(warmup=2)
    runner = GraphRunner(step, [8], policy=SplitPolicy(decode_token_threshold=4), pad_values={"slot": -1},
                         capturer=capturer)
    runner.run(batch(6), tbo=False)  # captures single (on padding), then replays it on the request
    assert step.calls[-1][2][:6].tolist() == list(range(100, 106))  # the replay saw the request
    before = len(step.calls)
    out = runner.run({"x": batch(5)["x"], "slot": batch(5)["slot"] + 50}, tbo=True)  # lazy TBO capture
    capture_calls = step.calls[before:-1]  # warm-up and capture of the TBO graph, then its replay
    assert len(capture_calls) == 3 and all(plan is not None for _, plan, _ in capture_calls)
    for _, _, slots in capture_calls:
        assert slots.eq(-1).all(), f"a capture ran on request data: slots {slots.tolist()}"
    assert step.calls[-1][2][:5].tolist() == list(range(150, 155))
    assert torch.equal(out["y"], Step()({"x": batch(5)["x"], "slot": batch(5)["slot"] + 50}, None)["y"])


def test_above_the_largest_bucket_runs_eager():
    step = Step()
    runner = GraphRunner(step, [2, 4], capturer=EagerCapturer())
    out = runner.run(batch(6))
    assert runner.last.how == "eager" and "exceed the largest bucket 4" in runner.last.reason
    assert step.calls[-1][0] == 6 and runner.last.plan is not None
    assert torch.equal(out["y"], Step()(batch(6), None)["y"])
    single_only = GraphRunner(Step(), [4], modes=("single",), capturer=EagerCapturer())
    single_only.run(batch(3), tbo=True)
    assert single_only.last.how == "eager" and "not captured" in single_only.last.reason


def test_bad_inputs_are_named():
    runner = GraphRunner(Step(), [4], capturer=EagerCapturer())
    with pytest.raises(ValueError, match="disagree on the batch size"):
        runner.run({"x": torch.zeros(3, 3), "slot": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(ValueError, match="batch is empty"):
        runner.run({"x": torch.zeros(0, 3), "slot": torch.zeros(0, dtype=torch.long)})
    runner.run(batch(2))
    with pytest.raises(ValueError, match="input 'x' is torch.float64"):
        runner.run({"x": torch.zeros(2, 3, dtype=torch.float64), "slot": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(ValueError, match="differ from the captured ones"):
        runner.run({"x": torch.zeros(2, 3)})
    with pytest.raises(TypeError, match="leading batch dimension"):
        runner.run({"x": torch.zeros(2, 3), "slot": 5})
    with pytest.raises(ValueError, match="batch_sizes must be positive"):
        GraphRunner(Step(), [0, 4])
    with pytest.raises(ValueError, match="modes must be"):
        GraphRunner(Step(), [4], modes=("fast",))


def test_cuda_capturer_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    runner = GraphRunner(Step(), [4])
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        runner.run(batch(2))
    assert GraphRunner(Step(), [4], capture=False).run(batch(2))["y"].shape == (2, 3)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tbo", [False, True])
def test_gpu_graph_replay_equals_eager_for_every_bucket(tbo):
    def step(inputs, plan):
        if plan is None:
            return {"y": torch.tanh(inputs["x"] @ w) + inputs["slot"].unsqueeze(1)}
        parts = split_inputs(inputs, plan)
        return {"y": merge_outputs([torch.tanh(p["x"] @ w) + p["slot"].unsqueeze(1) for p in parts], plan)}

    w = torch.randn(3, 5, device="cuda")
    runner = GraphRunner(step, [2, 4, 8], pad_values={"slot": -1})
    data = {k: v.cuda() for k, v in batch(8).items()}
    runner.capture_all(data)
    for n in range(1, 9):
        part = {k: v[:n] for k, v in data.items()}
        out = runner.run(part, tbo=tbo)
        assert runner.last.how == "graph"
        torch.testing.assert_close(out["y"], step(part, None)["y"], rtol=1e-6, atol=1e-6)
