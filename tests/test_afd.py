"""Attention-FFN disaggregation over real gloo processes."""

from collections import Counter

import pytest
import torch
from pydantic import ValidationError


from tbo.afd import AFDConfig, AFDMeta, AFDTopology
from tbo.harness.afd import AFDCase, run_afd
from tbo.harness.launch import RankError, launch


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_one_to_one_equals_colocated_forward(mode):
    attention, ffn = launch(run_afd, 2, AFDCase(mode=mode, num_seqs=6, ctx=12, num_layers=3, repeats=1))
    assert attention.split and attention.max_diff == 0.0
    # microbatch metadata arrives intact: every layer, both microbatches, in the order the strategy sends them
    first_step = [(m.layer_idx, m.microbatch_idx, m.num_microbatches) for m in ffn.received[:6]]
    assert first_step == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2), (2, 0, 2), (2, 1, 2)]
    assert all(m.hidden == 64 and m.dtype == torch.float32 and m.src == 0 for m in ffn.received)
    assert sum(m.num_tokens for m in ffn.received[:2]) == attention.tokens
    # every step reached the FFN: 3 unsplit and 3 split (the first, 1 repeat, 1 traced), 3 layers each
    assert Counter(m.num_microbatches for m in ffn.received) == {1: 3 * 3, 2: 3 * 3 * 2}
    # the benchmark's accounting: FFN busy time per step for each mode, where each step's time went on the attention
    assert set(ffn.ffn_busy_ms) == {1, 2}
    assert set(attention.attention_ms) == set(attention.wait_ms) == {"no_dbo", "dbo"}


@pytest.mark.dist
def test_two_to_one_topology():
    results = launch(run_afd, 3, AFDCase(mode="prefill", num_seqs=4, ctx=10, num_layers=2, repeats=1,
                                         num_attention_ranks=2, num_ffn_ranks=1))
    assert [r.role for r in results] == ["attention", "attention", "ffn"]
    assert all(r.max_diff == 0.0 for r in results[:2])
    assert {m.src for m in results[2].received} == {0, 1}


@pytest.mark.dist
def test_step_below_threshold_runs_unsplit():
    attention, ffn = launch(run_afd, 2, AFDCase(mode="decode", num_seqs=1, ctx=8, num_layers=2, repeats=1))
    assert not attention.split and attention.max_diff == 0.0
    assert {(m.microbatch_idx, m.num_microbatches) for m in ffn.received} == {(0, 1)}
    assert set(ffn.ffn_busy_ms) == {1}


@pytest.mark.dist
def test_ffn_death_raises_comm_timeout_with_context():
    """The attention rank's 5 s deadline names the wait; a hang would hit launch's 120 s one (a TimeoutError)."""
    case = AFDCase(mode="decode", num_seqs=4, ctx=8, num_layers=3, repeats=1, timeout_s=5, ffn_dies_after=3)
    with pytest.raises(RankError) as info:
        launch(run_afd, 2, case, timeout_s=120, failure_grace_s=30)
    message = str(info.value)
    assert "CommTimeoutError" in message and "rank 0: afd_recv (layer" in message and "microbatch" in message


def test_config_rejects_three_microbatches_and_bad_topologies():
    with pytest.raises(ValidationError, match="exactly 2 microbatches, got num_microbatches=3"):
        AFDConfig(role="attention", num_microbatches=3)
    AFDConfig(role="attention", num_microbatches=3, dbo=False)  # without DBO the microbatch count does not matter
    with pytest.raises(ValidationError, match="multiple of num_ffn_ranks"):
        AFDConfig(role="ffn", num_attention_ranks=3, num_ffn_ranks=2)
    with pytest.raises(ValidationError, match="decode_token_threshold=1 is lower than num_microbatches=2"):
        AFDConfig(role="attention", decode_token_threshold=1)
    cfg = AFDConfig(role="attention")
    assert (cfg.decode_token_threshold, cfg.prefill_token_threshold) == (2, 12)
    assert cfg.split_policy().plan(__import__("tbo").ForwardMode.DECODE, 1) is None


def test_meta_header_round_trip_and_topology():
    meta = AFDMeta(3, 1, 2, 17, 64, torch.bfloat16)
    back = AFDMeta.decode(meta.encode(), src=5)
    assert (back.layer_idx, back.microbatch_idx, back.num_microbatches, back.num_tokens, back.hidden, back.dtype,
            back.src) == (
        3, 1, 2, 17, 64, torch.bfloat16, 5)
    bad = meta.encode()
    bad[0] = 1
    with pytest.raises(RuntimeError, match="corrupt"):
        AFDMeta.decode(bad, src=2)
    topo = AFDTopology(4, 2)
    assert [topo.ffn_peer(a) for a in range(4)] == [4, 4, 5, 5]
    assert topo.attention_peers(5) == [2, 3]


@pytest.mark.dist
def test_gloo_receives_are_posted_before_their_messages_arrive():
    """Over an AFDGroup (two ranks, as tbo afd-ffn and a vLLM engine meet; here two threads): the attention side
    posts each answer's receives when it sends the request, the FFN side the next request's into one of two buffers
    of its largest request. Requests of several sizes round-trip intact (views of the right bytes of a reused
    buffer), each direction has its own connection, and a header announcing more than the buffer is refused by
    name before its payload is waited for."""
    import threading

    from tbo.afd.connector import TorchDistributedAFDConnector
    from tbo.afd.group import AFDGroup, AFDPeerError

    hidden, largest = 16, 8 * 16 * 4  # at most 8 fp32 tokens per request
    bound, served, failure = [], [], []

    def ffn_side() -> None:
        group = AFDGroup.listen("127.0.0.1:0", {"tbo_afd": 1}, timeout_s=30, on_listening=lambda h, p: bound.append(p))
        ffn = TorchDistributedAFDConnector(AFDTopology(1, 1), 30, group=group, max_request_bytes=largest)
        try:
            while True:
                hidden_states, meta = ffn.recv_attn_output()
                if meta.shutdown:
                    break
                assert ffn._next is not None  # the next request's receives are posted before this one's FFN
                served.append((meta.layer_idx, meta.microbatch_idx, meta.num_tokens))
                ffn.send_ffn_output(hidden_states * 2 + meta.layer_idx, meta)
        except AFDPeerError as e:
            failure.append(str(e))
        finally:
            ffn.flush()
            group.close()

    thread = threading.Thread(target=ffn_side, daemon=True)
    thread.start()
    while not bound:
        thread.join(0.05)
    group = AFDGroup.connect(f"127.0.0.1:{bound[0]}", timeout_s=30)
    assert len(group.pg.options._devices) == 2  # a connection per direction: a message's tag is its sender
    attention = TorchDistributedAFDConnector(AFDTopology(1, 1), 30, group=group)
    assert attention.post_early
    sent = {}
    for layer, mb, tokens in [(0, 0, 5), (0, 1, 3), (1, 0, 8), (1, 1, 1)]:
        meta = AFDMeta(layer, mb, 2, tokens, hidden)
        sent[layer, mb] = (meta, torch.randn(tokens, hidden))
        attention.send_attn_output(sent[layer, mb][1], meta)
        assert (layer, mb) in attention._answers  # posted at send time
    for (layer, mb), (meta, x) in sent.items():
        assert torch.equal(attention.recv_ffn_output(meta), x * 2 + layer)
    assert served == [(0, 0, 5), (0, 1, 3), (1, 0, 8), (1, 1, 1)] and not attention._answers
    attention._send(None, AFDMeta(2, 0, 1, 9, hidden), 1)  # a header alone, announcing 9 tokens: over the buffer
    attention.flush()
    thread.join(30)
    assert not thread.is_alive()
    assert failure and "9 tokens x 16: 576 bytes, more than the 512 this FFN rank takes" in failure[0], failure
    group.close()
