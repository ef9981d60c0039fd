"""``piper`` console script: sub-commands share one argparse tree; bad input exits 2 with the
SpecError message (key, value, rule, fix) and no traceback."""

from __future__ import annotations

import argparse
import sys
import warnings

from piper_core.errors import SpecError


def build_parser() -> argparse.ArgumentParser:
    from piper_core.cli import calibrate, capacity, plan, predict, routing, validate

    parser = argparse.ArgumentParser(prog="piper", description="Resource model and planner for MoE training.")
    sub = parser.add_subparsers(dest="command", required=True)
    predict.add_parser(sub)
    plan.add_parser(sub)
    capacity.add_parser(sub)
    calibrate.add_parser(sub)
    validate.add_parser(sub)
    routing.add_placement_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # recorded in what a command writes
    try:
        with warnings.catch_warnings():  # notices (old settings read, ...) go to stderr as one line each
            warnings.showwarning = lambda message, *_a, **_k: print(f"piper {args.command}: note: {message}",
                                                                   file=sys.stderr)
            return args.func(args)
    except SpecError as exc:
        print(f"piper {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
