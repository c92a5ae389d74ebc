"""AFD with overlap vs without: 1 attention rank and 1 FFN rank, each on its own core.

Here the overlap is real: the FFN process computes one microbatch while the attention process computes another. The
shapes make attention compute about equal to FFN compute (both are printed per mode, from a traced step, with the
FFN rank's busy time); fast (batch-variant) kernels. Prints, per case and microbatch count, a line
``speedup: <x>`` (no overlap's median step time over the split step's). Target: >= 1.6 at two microbatches.

``--microbatches N`` (or a list, ``2,3``: measured in one run, against one unsplit baseline) and ``--link
LAT_US,GBPS``: an emulated link between the two sides (`tbo.afd.link`, each direction), so that a round trip shows
on one machine; with a list, the line ``N vs M: <x>`` compares the counts. Then the pipeline model
(`tbo.tools.afd_pipeline`, what ``tbo simulate --afd`` runs) is given this run's own per-layer costs
(`tbo.harness.afd.measured_costs`) and the line ``model picks: N, measured best: M`` says whether it chose the count
that measured fastest (1: unsplit).

``--transport``: what carries the messages. "tcp" (the default) is the transport an engine's AFD runs on: an
`AFDGroup` pair over the authenticated socket that ``tbo afd-ffn`` serves, whose reader thread takes each message as
it arrives, the FFN side posting each request's header ahead. "gloo" is the launch's process group, a rendezvous per
message (a send's bytes move once its receive is posted): on the FFN side each request's payload then waits a
round trip through the attention process's busy core, about 0.6 ms a request, 16 a step.

Why these shapes. A split step pays its pipeline fill (microbatch 0's first attention, with the FFN rank idle) and
drain (the last microbatch's last FFN, with the attention rank idle) once, so with L balanced layers the ideal
speedup at two microbatches is 2L/(L+1): 1.6 at 4 layers, 1.78 at 8 (DeepSeek-V3 has 61). And a decode FFN call
reads every expert's weights whatever its batch, so two half-size calls cost more than one full-size call; at 512
sequences that costs the FFN rank about 15% more per step, at 128 about 50%. A round trip longer than a
microbatch's attention idles the attention side at two microbatches; a third fills it (docs/afd.md).
"""

from __future__ import annotations

import argparse
import statistics

from tbo.comm.emulated import parse_link_spec
from tbo.harness.afd import AFDCase, measured_costs, run_afd
from tbo.harness.launch import launch
from tbo.tools.afd_pipeline import choose_count

CASES = {
    "prefill": AFDCase(mode="prefill", num_seqs=8, ctx=128, hidden_size=512, num_layers=8, batch_invariant=False),
    "decode": AFDCase(mode="decode", num_seqs=512, ctx=64, hidden_size=1024, num_layers=8, batch_invariant=False),
}


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,M,... (2, 3 or 4), got {text!r}") from None
    if not counts or any(c not in (2, 3, 4) for c in counts):
        raise argparse.ArgumentTypeError(f"microbatch counts are 2, 3 or 4, got {text!r}")
    return counts


def _link(text: str) -> str:
    try:
        parse_link_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--microbatches", type=_counts, default=(2,), help="N, or N,M,...: 2, 3 or 4 (default 2)")
    parser.add_argument("--link", type=_link, default=None, help="LAT_US,GBPS between attention and FFN")
    parser.add_argument("--cases", default=",".join(CASES), help="which cases (default: all)")
    parser.add_argument("--transport", choices=("tcp", "gloo"), default="tcp",
                        help="tcp: an AFDGroup pair, as engines run (default); gloo: the launch's process group")
    parser.add_argument("--integrity", choices=("off", "headers", "full"), default="off",
                        help="tcp: a secret on both sides and what each frame's MAC covers (off: no secret)")
    args = parser.parse_args()
    for name in args.cases.split(","):
        case = AFDCase(**{**CASES[name].__dict__, "repeats": args.repeats, "microbatches": args.microbatches,
                          "link": args.link, "transport": args.transport,
                          "integrity": None if args.integrity == "off" else args.integrity})
        attention, ffn = launch(run_afd, 2, case, timeout_s=600)
        link = f", link {args.link}" if args.link else ""
        link += f", integrity {args.integrity}" if args.integrity != "off" else ""
        print(f"{name}: {attention.tokens} tokens, hidden {case.hidden_size}, {case.num_layers} layers{link}, "
              f"over {attention.transport}")
        for mode, microbatches in (("no_dbo", 1), ("dbo", args.microbatches[0])):
            print(f"  {mode}: attention compute {attention.attention_ms[mode]:.1f} ms, waiting for FFN "
                  f"{attention.wait_ms[mode]:.1f} ms; FFN rank busy {ffn.ffn_busy_ms.get(microbatches, 0.0):.1f} ms")
        print(f"  no overlap {statistics.median(attention.no_dbo_ms):.1f} ms, max diff {attention.max_diff:.2g}")
        for n in args.microbatches:
            print(f"  {n} microbatches {statistics.median(attention.split_ms[n]):.1f} ms")
            print(f"speedup: {attention.speedup_at(n):.2f}")
        for n in args.microbatches[1:]:
            first = args.microbatches[0]
            ratio = statistics.median(attention.split_ms[first]) / statistics.median(attention.split_ms[n])
            print(f"  {n} vs {first} microbatches: {ratio:.2f}x")
        # the pipeline model (tbo simulate --afd) on this run's own per-layer costs: does it pick the measured best?
        choice = choose_count(measured_costs(case, attention, ffn), attention.tokens, args.microbatches)
        steps = {1: statistics.median(attention.no_dbo_ms),
                 **{n: statistics.median(attention.split_ms[n]) for n in args.microbatches}}
        best = min(steps, key=steps.__getitem__)
        print(f"  model on measured costs: {choice.reason}")
        print(f"model picks: {choice.best}, measured best: {best}" + ("" if choice.best == best else " (differ)"))


if __name__ == "__main__":
    main()
