"""The DeepSpeed side of the switch-1t recipe: plan as ``piper_deepspeed.initialize`` will at launch,
print what rank 0 will print, and write the DeepSpeed JSON config that pins that plan.

    python recipes/switch-1t/deepspeed_plan.py --cluster dgx-h100 --gpus 1024 [--out FILE]
    python recipes/switch-1t/deepspeed_plan.py --parallel FILE    # its plan as piper predict --parallel

Why not ``piper plan --export-deepspeed``: that export picks the best plan DeepSpeed *could*
express (recompute, bf16 gradients and optimizer offload included), and
``piper_deepspeed.initialize`` refuses a pinned recompute and plans without the memory savers; for
switch-1t every exported plan had recompute on, so none of those configs would launch. This script
runs the adapter's own search (:func:`piper_deepspeed.plan_for`, no torch.distributed needed) and
writes its plan with Piper's exporter (:func:`piper_core.export.deepspeed_config`), plus
``"model": "switch-1t"``. Exit status 1 with the adapter's reason when nothing fits.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

MODEL = "switch-1t"
GLOBAL_BATCH = 2048  # sequences of 2048 tokens: 4 Mi tokens per step (see README, "The model")


def request(cluster: str) -> dict[str, Any]:
    """The config a user writes: batch, bf16, ZeRO-1 and an unpinned piper block."""
    return {"train_batch_size": GLOBAL_BATCH, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
            "piper": {"cluster": cluster, "model": MODEL, "a2a": "auto", "chunks": "auto"}}


def plan(cluster: str, gpus: int) -> tuple[dict[str, Any], str]:
    """(the launch config pinning the adapter's plan, what rank 0 prints for it).
    Raises :class:`piper_core.errors.Infeasible` when no plan DeepSpeed can run fits."""
    warnings.filterwarnings("ignore")
    from piper_core.export import deepspeed_config
    from piper_deepspeed.initialize import node_topology, plan_for, report, rewrite_config

    asked = request(cluster)
    choice = plan_for(asked, gpus)
    _, changes = rewrite_config(asked, choice)
    printed = report(choice, changes, asked, topology=node_topology(choice.prediction.cluster, gpus))
    config = deepspeed_config(choice.prediction)
    config["piper"] = {"model": MODEL} | config["piper"]
    return config, printed


def render(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2) + "\n"


def parallel(config: dict[str, Any]) -> str:
    """The ``piper predict --parallel`` string of a config written by :func:`plan` (its pinned plan)."""
    pin, block = config["piper"]["plan"], config["piper"]
    return (f"tp={pin['tp']},pp={pin['pp']},ep={pin['ep']},etp={pin['etp']},cp={pin['cp']},mbs={pin['mbs']},"
            f"gbs={config['train_batch_size']},recompute={pin['recompute']},"
            f"dist_opt={int(config['zero_optimization']['stage'] >= 1)},a2a={block['a2a']}"
            + (f",chunks={block['chunks']}" if block["a2a"] == "pipelined" else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deepspeed_plan.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", help="cluster preset or ClusterSpec YAML")
    p.add_argument("--gpus", type=int, help="world size (DeepSpeed ranks)")
    p.add_argument("--out", type=Path, help="write the DeepSpeed JSON config here")
    p.add_argument("--parallel", type=Path, metavar="CONFIG",
                   help="print the piper predict --parallel string of a config this script wrote, and exit")
    args = p.parse_args(argv)
    if args.parallel is not None:
        print(parallel(json.loads(args.parallel.read_text())))
        return 0
    if args.cluster is None or args.gpus is None:
        p.error("--cluster and --gpus are required")
    from piper_core.errors import Infeasible

    try:
        config, printed = plan(args.cluster, args.gpus)
    except Infeasible as exc:
        print(f"piper_deepspeed: infeasible: {exc}")
        return 1
    print(printed)
    if args.out is not None:
        args.out.write_text(render(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
