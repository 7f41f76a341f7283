"""`streamrl` command line. Heavy modules are imported inside the commands so `--help` is instant.

streamrl train --config configs/default.toml [key=value ...]
streamrl train --resume RUN_DIR [key=value ...]
streamrl train --dry-run --config configs/default.toml [key=value ...]   (config + memory estimate)
streamrl train --replay RUN_DIR [key=value ...]   (re-train on the run's logged batches)
streamrl rollout --config configs/default.toml [--num-prompts N] [--out FILE]   (print trajectories)
streamrl eval RUN_DIR [--checkpoint base|latest|all|STEP ...] [eval.k=4 ...]   (held-out, offline)
streamrl eval --config configs/default.toml [key=value ...]                   (the starting model)
streamrl report RUN_DIR
streamrl scale RUN_DIR --engines N | --preempt ENGINE_ID   (engines of a running train, streaming.elastic)
streamrl staleness RUN_DIR                   (lags, version spans, length bias, reward by lag)
streamrl staleness reweight RUN_DIR --checkpoint STEP [--correction SPEC ...] [--steps A:B] [--out DIR]
streamrl trace RUN_DIR [--window A:B] [--out FILE]   (merge the lifecycle trace, print where the time went)
streamrl buffer export DIR --parquet OUT
streamrl buffer stats DIR
streamrl plan --model 7B --gpus 256 --tool-latency p50=2s,p99=60s   (simulated split, busy, lag, throughput)
streamrl calibrate RUN_DIR [RUN_DIR ...]     (fit the simulator to runs of this machine)
"""

from __future__ import annotations

import argparse
import sys


def _train(args: argparse.Namespace) -> int:
    from streamrl.streaming import preflight

    if args.replay:
        from streamrl.streaming.replay import replay_main

        return replay_main(args.replay, args.overrides)
    if args.dry_run:  # resolve and estimate only: no Ray, no run directory
        print(preflight.dry_run(args.config, args.overrides, args.resume))
        return 0
    preflight.check(preflight.resolve_config(args.config, args.overrides, args.resume))
    from streamrl.streaming.train import train_main

    return train_main(config=args.config, overrides=args.overrides, resume=args.resume)


def _rollout(args: argparse.Namespace) -> int:
    from streamrl.streaming.eval import rollout_main

    return rollout_main(
        config=args.config, overrides=args.overrides, num_prompts=args.num_prompts, out=args.out, show=args.show
    )


def _eval(args: argparse.Namespace) -> int:
    from streamrl.streaming.eval_cli import eval_main

    dirs = [a for a in args.args if "=" not in a]  # RUN_DIR and key=value overrides, in any order
    if len(dirs) > 1:
        raise ValueError(f"streamrl eval takes one RUN_DIR, got {dirs}")
    return eval_main(
        run_dir=dirs[0] if dirs else None,
        config=args.config,
        overrides=[a for a in args.args if "=" in a],
        checkpoints=args.checkpoint,
        out=args.out,
    )


def _report(args: argparse.Namespace) -> int:
    from streamrl.observability.report import write_report

    path = write_report(args.run_dir)
    print(f"report written to {path}")
    return 0


def _staleness(args: argparse.Namespace) -> int:
    if args.run_dir == "reweight":  # `staleness reweight ...` (a run dir named so: write ./reweight)
        from streamrl.streaming.reweight_cli import reweight_main

        return reweight_main(args.reweight_args)
    if args.reweight_args:
        raise ValueError(f"staleness takes one RUN_DIR, got extra arguments {args.reweight_args}")
    from streamrl.buffer.staleness import summary, write_report

    json_path, html_path, result = write_report(args.run_dir)
    print(summary(result))
    print(f"wrote {json_path} and {html_path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrl",
        description="Fully asynchronous streaming RL for tool-using LLM agents.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging; train: every part's logs on the console too (else in RUN_DIR/logs/)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _add_train(sub)
    _add_rollout_and_eval(sub)
    report = sub.add_parser("report", help="write RUN_DIR/report.html (plots + trajectory viewer)")
    report.add_argument("run_dir")
    report.set_defaults(func=_report)

    staleness = sub.add_parser(
        "staleness",
        help="RUN_DIR/staleness.{json,html} from the run's durable buffer; "
        "`staleness reweight -h`: each correction on the logged batches under a checkpoint",
    )
    staleness.add_argument("run_dir", help="a run directory, or `reweight` followed by its arguments")
    staleness.add_argument("reweight_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    staleness.set_defaults(func=_staleness)

    from streamrl.buffer.cli import register

    register(sub)  # `buffer stats DIR`, `buffer export DIR --parquet OUT`
    from streamrl.observability.trace_cli import register as register_trace

    register_trace(sub)  # `trace RUN_DIR [--window A:B] [--out FILE]`
    from streamrl.sim.cli import register as register_sim

    register_sim(sub)  # `plan --model 7B --gpus 256 ...`, `calibrate RUN_DIR ...`
    from streamrl.streaming.elastic import register as register_scale

    register_scale(sub)  # `scale RUN_DIR --engines N | --preempt ENGINE_ID`
    return parser


def _add_train(sub: argparse._SubParsersAction) -> None:
    """`streamrl train`: a run from a config, resumed, dry-run or replayed."""
    train = sub.add_parser("train", help="train (async by default; trainer.mode=sync for the baseline)")
    train.add_argument("--config", help="TOML run file (configs/*.toml)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a killed or finished run from its directory")
    train.add_argument(
        "--dry-run", action="store_true", help="print the resolved config and the memory estimate; start nothing"
    )
    train.add_argument(
        "--replay",
        metavar="RUN_DIR",
        help="re-train a fresh learner on exactly the batches RUN_DIR trained on, in order (no Ray)",
    )
    train.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="every part's logs on the console too (else in RUN_DIR/logs/)",
    )
    train.add_argument("overrides", nargs="*", help="config overrides, e.g. trainer.total_steps=10")
    train.set_defaults(func=_train)


def _add_rollout_and_eval(sub: argparse._SubParsersAction) -> None:
    """`streamrl rollout` (agent loops only) and `streamrl eval` (held-out evaluation of checkpoints)."""
    rollout = sub.add_parser("rollout", help="run agent loops only (evaluation), print and save trajectories")
    rollout.add_argument("--config", help="TOML run file")
    rollout.add_argument("--num-prompts", type=int, default=4)
    rollout.add_argument("--out", default=None, help="JSONL file for the trajectories (default: runs/rollout-*.jsonl)")
    rollout.add_argument("--show", type=int, default=3, help="how many trajectories to print decoded")
    rollout.add_argument("overrides", nargs="*", help="config overrides")
    rollout.set_defaults(func=_rollout)

    evaluate = sub.add_parser(
        "eval",
        help="held-out evaluation of a run's base model or checkpoints (avg@k, pass@k, pass^k, paired comparison)",
    )
    evaluate.add_argument("--config", help="evaluate this config's starting model instead of a run's")
    evaluate.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        help="base, latest, all or a learner step; repeatable (default: base and latest)",
    )
    evaluate.add_argument("--out", help="folder for the rows (default: RUN_DIR/eval_offline)")
    evaluate.add_argument(
        "args",
        nargs="*",
        metavar="RUN_DIR|key=value",
        help="a run directory, and config overrides, e.g. eval.num_prompts=128 eval.k=4",
    )
    evaluate.set_defaults(func=_eval)


def parse_argv(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as `main` reads it: `eval` also takes overrides after its options."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "eval":
        args.args += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_argv(argv)
    from streamrl.observability.logs import setup_console
    from streamrl.streaming.errors import StreamRLError

    setup_console(verbose=args.verbose)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad config / input: one clear line, no traceback
        print(f"streamrl: error: {exc}", file=sys.stderr)
        return 2
    except StreamRLError as exc:  # a failure explained in full (a part killed for memory, a failed child)
        print(f"streamrl: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
