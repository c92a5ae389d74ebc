"""The ``tbo`` command: inspect strategies and their compiled schedules without running a model."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from pydantic import ValidationError

from tbo.core.errors import StrategyError
from tbo.core.strategy import OperationsStrategy
from tbo.tools.inputs import describe_validation_error, load_json_model, positive

__all__ = ["main", "load_strategy"]


def load_strategy(source: str, fragment: bool = False) -> OperationsStrategy:
    """A strategy from a JSON file path, a registered strategy's name, or ``module:NAME``.

    ``module:NAME`` imports ``module`` (which may register strategies, as ``strategy_modules`` does in vLLM), then
    takes ``NAME`` from the registry or, failing that, from the module: an `OperationsStrategy` or a function
    returning one. ``fragment=True`` reads a file without the transfer-ordering check, so that `tbo lint` can report
    what is wrong with it instead of refusing to load it."""
    path = Path(source)
    if path.is_file():
        try:
            extra = {"fragment": True} if fragment else {}
            return load_json_model(OperationsStrategy, path, "strategy file", **extra)
        except ValueError as exc:
            raise StrategyError(str(exc)) from None
    from tbo import strategies

    module_name, colon, name = source.rpartition(":")
    if colon and module_name and name:
        module = import_strategy_module(module_name)
        if name in strategies.names():
            return strategies.get(name)
        found = getattr(module, name, None)
        if callable(found) and not isinstance(found, OperationsStrategy):
            found = found()
        if not isinstance(found, OperationsStrategy):
            raise StrategyError(f"{source!r}: {module_name} neither registers a strategy {name!r} nor defines one "
                                f"(an OperationsStrategy or a function returning one); registered: "
                                f"{', '.join(strategies.names())}")
        return found if found.name else found._replace(name=name)
    if source in strategies.names():
        return strategies.get(source)
    raise StrategyError(f"{source!r} is neither a strategy JSON file nor a registered strategy "
                        f"({', '.join(strategies.names())}), nor module:NAME. A strategy written in Python: pass "
                        "module:NAME (or --import MODULE and its registered name), or write its JSON with "
                        "`tbo show module:NAME --json > mine.json` (strategy.model_dump_json())")


def import_strategy_module(name: str) -> Any:
    """Import a module that defines or registers strategies; a failure names it (`tbo.strategies.import_modules`).

    The working directory is searched first, as ``python -m`` does: the ``tbo`` command's own ``sys.path`` starts at
    its script's folder, where a user's module never is."""
    from tbo.strategies import import_modules

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    return import_modules([name], what="--import")[0]


def render_strategy(strategy: OperationsStrategy, delta: int | None, microbatches: int) -> str:
    """The stages, then the interleaved schedule of ``microbatches`` copies of the strategy."""
    delta = strategy.delta_stages if delta is None else delta
    rounds = strategy.schedule(microbatches, delta).num_rounds
    return (
        f"{strategy.describe()}\n\nschedule: {microbatches} microbatches, delta_stages={delta}, "
        f"{rounds} rounds\n{strategy.render_schedule(microbatches, delta)}"
    )


#: the most layers `lint` / `simulate` chain and microbatches `show` / `lint` schedule: far past any model, and
#: small enough that the schedule (quadratic in microbatches) is built in seconds, not minutes or a MemoryError
MAX_LAYERS = 1024
MAX_MICROBATCHES = 64


def at_most(high: int) -> Any:
    """An argparse type: `positive`, and at most ``high``."""
    def parse(text: str) -> int:
        value = positive(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"expected at most {high}, got {value}")
        return value

    parse.__name__ = "positive"
    return parse


def _cmd_show(args: argparse.Namespace) -> int:
    strategy = load_strategy(args.strategy)
    if args.delta is not None:  # the constructor's own check, so the header and the schedule are a valid strategy
        try:
            strategy = strategy._replace(delta_stages=args.delta)
        except ValueError as exc:
            why = describe_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
            raise StrategyError(f"--delta {args.delta}: {why}") from None
    if args.json:
        print(strategy.model_dump_json(indent=2))
        return 0
    print(render_strategy(strategy, None, args.microbatches))
    return 0


def _cmd_ops(args: argparse.Namespace) -> int:
    from tbo.tools.layer_kinds import LAYER_KINDS, kind_flows

    kinds = [args.layer_kind] if args.layer_kind else list(LAYER_KINDS)
    for i, kind in enumerate(kinds):
        flows = kind_flows(kind)
        print(f"{'' if i == 0 else chr(10)}{kind}: {LAYER_KINDS[kind].about}")
        width = max(map(len, flows))
        for name, flow in flows.items():
            print(f"  {name:<{width}}  {'(undeclared)' if flow is None else flow.describe()}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from tbo.tools.simulate import CostModel, compare, recommend
    from tbo.tools.trace import save_chrome_json, save_png, summary

    if args.afd:
        return _simulate_afd(args)
    if args.strategy is None or args.costs is None:
        raise ValueError("tbo simulate needs a STRATEGY and --costs COSTS.json (or --afd COSTS.json for an AFD "
                         "pipeline)")
    layer = load_strategy(args.strategy)
    strategy = OperationsStrategy.concat([layer] * args.layers, name=layer.name)
    costs = load_json_model(CostModel, args.costs, "costs file")
    unpriced = costs.unpriced(layer)
    if unpriced:
        print(f"tbo simulate: warning: {args.costs} prices no op {', '.join(unpriced)}: each is charged the default "
              f"cost ({costs.default.describe()}); add them to its 'ops'", file=sys.stderr)
    mode = args.mode or ("prefill" if "prefill" in (layer.name or "") else "decode")
    c = compare(strategy, costs, args.tokens)
    single, tbo = summary(c.single.trace), summary(c.tbo.trace)
    print(f"strategy {layer.name or args.strategy} x {args.layers} layers, {args.tokens} tokens")
    print(f"single: {c.single.step_s * 1e3:.3f} ms  ({single})")
    print(f"TBO:    {c.tbo.step_s * 1e3:.3f} ms  ({tbo})")
    print(f"lower bound max(compute, comm): {c.lower_bound_s * 1e3:.3f} ms")
    print(f"speedup: {c.speedup:.2f}x")
    print(recommend(strategy, costs, args.tokens, mode).reason)
    if args.trace:
        print(f"wrote {save_chrome_json(c.tbo.trace, args.trace)}")
    if args.png:
        print(f"wrote {save_png(c.tbo.trace, args.png)}")
    return 0


def _simulate_afd(args: argparse.Namespace) -> int:
    """``tbo simulate --afd COSTS.json``: the AFD pipeline at each microbatch count (`tbo.tools.afd_pipeline`)."""
    from tbo.tools.afd_pipeline import AFDCosts, parse_counts, report

    costs = load_json_model(AFDCosts, args.afd, "AFD costs file")
    if args.layers != 1:
        costs = costs.model_copy(update={"num_layers": args.layers})
    for line in report(costs, args.tokens, parse_counts(args.microbatches)):
        print(line)
    return 0


def _cmd_lint(args: argparse.Namespace) -> int:
    from tbo.tools.lint import lint, tally

    layer = load_strategy(args.strategy, fragment=True)  # ordering problems are findings here, not a load error
    limit = None
    if args.low_latency or args.backend == "deepep_low_latency":
        from tbo.comm.deepep import LOW_LATENCY_LIMIT

        limit = LOW_LATENCY_LIMIT
    if args.max_in_flight is not None:
        from tbo.core.inflight import InFlightLimit

        limit = InFlightLimit(args.max_in_flight, backend=f"--max-in-flight {args.max_in_flight}")
    ops = None
    if args.layer_kind:
        from tbo.tools.layer_kinds import kind_flows

        ops = kind_flows(args.layer_kind)
    findings = lint(layer, args.microbatches, backend=limit, layers=args.layers, ops=ops)  # in the user's layer
    for f in findings:
        print(f)
    errors = sum(f.level == "error" for f in findings)
    over = f", over {limit.backend}" if limit is not None else ""
    kind = f", ops of {args.layer_kind}" if args.layer_kind else ""
    print(f"{layer.name or args.strategy}: {tally(findings)} ({args.layers} layers, {args.microbatches} "
          f"microbatches{over}{kind})")
    return 1 if errors else 0


def _cmd_stats(args: argparse.Namespace) -> int:
    import time

    from tbo.tools.stats_view import load, render

    shown = 0
    while True:
        table = render(load(args.source, timeout_s=args.timeout))
        if args.watch is None:
            print(table)
            return 0
        # a live view: clear the terminal, then the table under the time it was read
        print(f"\x1b[H\x1b[2J{time.strftime('%H:%M:%S')}  {' '.join(args.source)}  (every {args.watch:g} s)\n"
              f"{table}", flush=True)
        shown += 1
        if args.count and shown >= args.count:
            return 0
        time.sleep(args.watch)


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tbo", description="Two-batch overlap: inspect strategies and schedules.")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE first, so that the strategies it registers can be named (repeatable)")
    sub = parser.add_subparsers(dest="command", required=True)
    from tbo.tools.layer_kinds import LAYER_KINDS

    layer_kinds = list(LAYER_KINDS)
    source = ("a registered strategy name (e.g. deepseek_decode), module:NAME (a strategy a Python module registers "
              "or defines), or a strategy JSON file")
    show = sub.add_parser("show", help="print a strategy's stages and its interleaved schedule")
    show.add_argument("strategy", help=source)
    show.add_argument("--json", action="store_true",
                      help="print the strategy's JSON (what a file, vLLM's 'strategies' key and model_validate_json "
                           "read) instead of its schedule")
    show.add_argument("--delta", type=int, default=None,
                      help="delta_stages (default: the strategy's own); 0 to stages - 1, as the constructor checks")
    show.add_argument("--microbatches", type=at_most(MAX_MICROBATCHES), default=2, help="number of microbatches (default 2)")
    show.set_defaults(func=_cmd_show)
    sim = sub.add_parser("simulate", help="predict single-batch vs TBO step time from a cost model")
    sim.add_argument("strategy", nargs="?", help=source + " (not with --afd)")
    sim.add_argument("--tokens", type=positive, required=True, help="tokens in the step")
    sim.add_argument("--costs", help="a CostModel JSON file (see tbo.tools.simulate.CostModel)")
    sim.add_argument("--afd", metavar="COSTS.json",
                     help="instead: an AFD pipeline's costs (tbo.tools.afd_pipeline.AFDCosts): attention and FFN "
                          "stage costs and the link; prints each microbatch count and which one pays")
    sim.add_argument("--microbatches", default="2,3,4", help="--afd: the microbatch counts to compare (default 2,3,4)")
    sim.add_argument("--layers", type=at_most(MAX_LAYERS), default=1,
                     help="layers of the strategy to chain (default 1; --afd: replaces the file's num_layers)")
    sim.add_argument("--mode", choices=("decode", "prefill"), default=None,
                     help="the step's phase, as the verdict reports it (default: prefill for a strategy whose name "
                          "says prefill, else decode)")
    sim.add_argument("--png", help="write the simulated TBO timeline as a PNG")
    sim.add_argument("--trace", help="write the simulated TBO trace as Chrome/Perfetto JSON")
    sim.set_defaults(func=_cmd_simulate)
    lint = sub.add_parser("lint", help="check a strategy for overlap bugs; exits 1 on errors")
    lint.add_argument("strategy", help=source)
    lint.add_argument("--microbatches", type=at_most(MAX_MICROBATCHES), default=2)
    lint.add_argument("--layers", type=at_most(MAX_LAYERS), default=2, help="layers of the strategy to chain (default 2)")
    lint.add_argument("--backend", choices=("deepep_low_latency",),
                      help="check the schedule against this backend's limit on transfers in flight (DeepEP V1 "
                           "low-latency: one un-received call at a time, across microbatches and layers)")
    lint.add_argument("--low-latency", action="store_true", help="the same as --backend deepep_low_latency")
    lint.add_argument("--max-in-flight", type=positive, default=None,
                      help="check against a limit of your own: at most N transfers (any kind) in flight at once")
    lint.add_argument("--layer-kind", choices=layer_kinds,
                      help="check the ops' names and data flow against this kind of layer's declared ops, as binding "
                           "the strategy to it would (`tbo ops` lists them)")
    lint.set_defaults(func=_cmd_lint)
    ops = sub.add_parser("ops", help="list the ops a kind of layer provides, with what each reads and writes")
    ops.add_argument("--layer-kind", choices=layer_kinds, help="one kind (default: every kind)")
    ops.set_defaults(func=_cmd_ops)
    stats = sub.add_parser("stats", help="what tbo did in an engine, as a table: from stats_file(s) or a served "
                                         "engine's /metrics")
    stats.add_argument("source", nargs="+",
                       help="a stats_file path ('{rank}' in it: every rank's), or an http(s) URL of /metrics (a bare "
                            "host:port URL gets /metrics)")
    stats.add_argument("--watch", type=_seconds, nargs="?", const=2.0, default=None, metavar="SECONDS",
                       help="refresh every SECONDS (default 2) until interrupted")
    stats.add_argument("--count", type=positive, default=None, help="with --watch: stop after COUNT tables")
    stats.add_argument("--timeout", type=_seconds, default=10.0, help="seconds to wait for a URL (default 10)")
    stats.set_defaults(func=_cmd_stats)
    from tbo.tools.predict.cli import add_parser as add_predict_parser

    add_predict_parser(sub)
    from tbo.integrations.vllm.afd.ffn import add_parser as add_afd_ffn_parser

    add_afd_ffn_parser(sub)
    return parser


#: The exit status of a command whose reader went away (`tbo ... | head`): the shell's for a SIGPIPE death, 128 + 13.
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for module in args.imports:
            import_strategy_module(module)
        status = int(args.func(args))
        sys.stdout.flush()  # a reader that left during the last lines is found here, not at interpreter exit
        return status
    except BrokenPipeError:  # the reader stopped reading: nothing to report, as Unix tools do
        # point stdout at /dev/null, so that the interpreter's final flush cannot raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:  # `tbo stats --watch` ends with ^C
        return 130
    except (StrategyError, ValueError, OSError) as exc:   # bad input, a missing or unreadable file: say which
        print(f"tbo {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
