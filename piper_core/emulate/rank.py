"""One rank of an emulated cluster: ``python -m piper_core.emulate.rank SPEC_JSON RANK``.

Started by :func:`piper_core.emulate.launch.launch` inside the rank's node namespace, with
``GLOO_SOCKET_IFNAME`` naming the node's interface. Initialises the default gloo group through the
TCP store on node 0, calls the target, and writes ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": traceback}`` to ``rank<r>.json`` in the run's directory.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from piper_core.emulate.launch import RankInfo


def load_target(target: str) -> Callable[..., Any]:
    """The function named by ``"package.module:function"`` or ``"/path/file.py:function"``."""
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {where}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _write(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    rank = int(argv[1])
    # see the modules the launching process saw (pytest's rootdir, an editable checkout)
    sys.path.extend(p for p in spec["sys_path"] if p not in sys.path)
    info = RankInfo(**spec["infos"][rank])
    out = Path(spec["out_dir"]) / f"rank{rank}.json"
    if spec.get("realtime"):  # before torch starts its threads: they inherit the policy
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(spec["realtime"]))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    ok = False
    try:
        fn = load_target(spec["target"])
        dist.init_process_group("gloo", init_method=f"tcp://{info.master_address}:{info.port}", rank=rank,
                                world_size=info.world_size,
                                timeout=timedelta(seconds=info.collective_timeout_s))
        result = fn(info, *spec["args"])
        _write(out, {"ok": True, "result": result})
        ok = True
        dist.barrier()  # rank 0 hosts the store: let every rank finish before any leaves
    except BaseException:  # report everything (KeyboardInterrupt included) to the launcher
        if not ok:
            _write(out, {"ok": False, "error": traceback.format_exc(), "failed_at": time.time()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
