"""``python -m piper_megatron SCRIPT [Megatron arguments] [--piper ...]``: run a Megatron-LM
training script (e.g. ``pretrain_gpt.py``) with Piper's flags, without editing it.

* Without ``--piper`` the script runs exactly as ``python SCRIPT ...`` would: nothing of Megatron
  is imported or changed by the launcher.
* With ``--piper``: :func:`piper_megatron.install` hooks Megatron's argument parsing (the plan and
  the rewrite happen when the script validates its arguments, before any model is built), then
  the script runs as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as Python would set them.
* With ``--piper --piper-plan-only``: the plan is made from the command line alone and printed;
  the script is neither run nor read (it need not exist), and neither ``megatron.training`` nor a
  GPU is needed. The world size comes from ``--piper-world-size N`` or the launcher's WORLD_SIZE.
  Where megatron-core releases read an argument differently, the plan reads it as the newest
  supported release does (:mod:`piper_megatron.versions`; a NullTokenizer's ``--vocab-size``), so
  a plan does not depend on the megatron-core installed where it is made; the run's own plan, made
  in its ``validate_args``, reads it as the installed release does.

Exit status: 0 on success, 1 when no plan fits, 2 for bad input (the message says how to fix it).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from piper_core.errors import Infeasible, SpecError
from piper_megatron.pins import OFF_NAMES

USAGE = ("usage: python -m piper_megatron SCRIPT [Megatron arguments] --piper --piper-cluster NAME|YAML\n"
         "       [--piper-profile YAML] [--piper-a2a auto|flat|hierarchical] [--piper-chunks N|auto|tune]\n"
         "       [--piper-plan-only [--piper-world-size N]] [--piper-trace FILE] [--piper-off NAME[,NAME...]]\n"
         "       [--piper-defer-wgrad] [--piper-placement FILE] [--piper-routing FILE ...]\n"
         "       [--piper-migrate-every N [--piper-migrate-horizon H]]\n"
         "--piper-off NAME: a Megatron switch the plan must leave off, one of: " + ", ".join(OFF_NAMES))


def _world_size(flag: int | None) -> int:
    """``--piper-world-size`` or, under a launcher, its WORLD_SIZE (read here, at the top level)."""
    if flag is not None:
        return flag
    value = os.environ.get("WORLD_SIZE", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise SpecError("--piper-world-size", None, "plan-only needs the world size to plan for, and no launcher set "
                    "WORLD_SIZE", "add --piper-world-size N (e.g. 64)")


def plan_only(script: str, args: Sequence[str]) -> int:
    """Plan from the command line and print what rank 0 would print; never runs ``script``."""
    from piper_megatron.args import apply_settings, megatron_settings, parse_megatron_args, parse_piper_options
    from piper_megatron.install import dispatcher_description, plan_job, report

    options = parse_piper_options(args)
    ns = parse_megatron_args(args)
    planned = plan_job(ns, args, options, world_size=_world_size(options.world_size))
    changes = apply_settings(ns, megatron_settings(planned.model, planned.top.plan, planned.pins))
    print(report(planned, changes, dispatcher_description(planned)))
    where = "" if Path(script).is_file() else " (not found here; plan-only does not need it)"
    print(f"piper: plan only: {script}{where} was not run and no model was built")
    return 0


def run_script(script: str, args: Sequence[str]) -> None:
    """Run ``script`` as ``__main__`` with Piper's hooks installed when ``--piper`` is given."""
    path = Path(script)
    if not path.is_file():
        raise SpecError("SCRIPT", script, "is not a file", "pass the path of the training script, e.g. "
                        "Megatron-LM/pretrain_gpt.py")
    sys.argv = [script, *args]
    sys.path[0] = str(path.resolve().parent)  # as `python SCRIPT` does: its directory first
    if "--piper" in args or any(a.startswith("--piper=") for a in args):
        from piper_megatron.install import install

        install(args)
    runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    script, args = argv[0], argv[1:]
    try:
        from piper_megatron.args import parse_piper_options

        options = parse_piper_options(args)
        if options.enabled and options.plan_only:
            return plan_only(script, args)
        run_script(script, args)
    except SpecError as exc:
        print(f"piper_megatron: error: {exc}", file=sys.stderr)
        return 2
    except Infeasible as exc:
        print(f"piper_megatron: infeasible: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # a collective of Megatron's: say where this rank stopped, then the traceback
        from piper_megatron.faults import collective_failure

        line = collective_failure(exc)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
