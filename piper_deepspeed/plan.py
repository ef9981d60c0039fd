"""``python -m piper_deepspeed.plan CONFIG.json --world-size N``: what ``piper_deepspeed.initialize``
will print on rank 0 for this config on N ranks -- the search, the plan, the config changes and the
MoE layers' all-to-all -- without torch.distributed, a launcher or a model (:func:`plan_for`).
``--json``: the plan and the rewritten config as JSON. Exit status 1 with the reason when no plan
DeepSpeed can run fits; 2 for a config the block refuses (the key, the value, the rule and the fix).
On a host without a GPU, DeepSpeed logs a timestamped accelerator-detection warning when it is
imported; ``DS_ACCELERATOR=cpu`` in the environment names the host instead and keeps it quiet.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m piper_deepspeed.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path, help="DeepSpeed JSON config with a \"piper\" block")
    p.add_argument("--world-size", type=int, required=True, help="DeepSpeed ranks the job will run on")
    p.add_argument("--pipeline", action="store_true", help="the model is a PipelineModule (Piper picks its stages)")
    p.add_argument("--json", action="store_true", help="print the plan and the rewritten config as JSON")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    from piper_core.errors import Infeasible, SpecError
    from piper_core.export import plan_label
    from piper_deepspeed.initialize import node_topology, plan_for, report, rewrite_config

    try:
        config = json.loads(a.config.read_text())
    except (OSError, ValueError) as exc:
        print(f"python -m piper_deepspeed.plan: {a.config}: cannot read a JSON config ({exc})", file=sys.stderr)
        return 2
    try:
        choice = plan_for(config, a.world_size, pipeline=a.pipeline)
    except (SpecError, Infeasible) as exc:  # a refused config: 2; nothing fits: 1
        print(f"python -m piper_deepspeed.plan: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, SpecError) else 1
    rewritten, changes = rewrite_config(config, choice)
    if a.json:
        print(json.dumps({"plan": plan_label(choice.plan, gbs=True), "world_size": a.world_size,
                          "changes": [{"key": k, "old": old, "new": new} for k, old, new in changes],
                          "config": rewritten}, indent=1, default=str))
        return 0
    print(report(choice, changes, config, topology=node_topology(choice.prediction.cluster, a.world_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
