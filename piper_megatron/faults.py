"""What ``python -m piper_megatron`` adds when a rank's training ends in a collective that is not Piper's.

Piper's own exchanges raise :class:`~piper_core.runtime.timeouts.CollectiveError`, which names the
exchange, the stage, the group's ranks and whether a peer is gone or the deadline passed. Megatron's
own collectives (DDP's gradient reduce in ``finish_grad_sync``, the pipeline's send/receive in
``p2p_communication``, the loss all-reduce) raise the backend's error, which names a peer's address
at most (gloo: "Connection reset by peer [127.0.0.1]:1759"). For those the launcher prints one more
line before the traceback: this rank, the world size, the Megatron function that was waiting, and
what the backend said, so that every rank's log says where it stopped and why
(tests/megatron/test_faults.py shows which ranks end where when one is killed).
"""

from __future__ import annotations

import os
import sys
import traceback

from piper_core.runtime.timeouts import CollectiveError, first_line, kind_of


def _rank_and_world() -> tuple[str, str]:
    """This process's rank and the world size: torch.distributed's once initialised, else the
    launcher's RANK / WORLD_SIZE (read here, at the top level of the launcher)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_rank()), str(dist.get_world_size())
    return os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")


def _megatron_frame(exc: BaseException) -> str:
    """The innermost frame of the traceback inside Megatron: ``function (megatron/...py:line)``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/" in f.filename.replace(os.sep, "/")]
    if not frames:
        return "a collective outside Megatron"
    f = frames[-1]
    path = f.filename.replace(os.sep, "/")
    return f"{f.name} ({path[path.rindex('/megatron/') + 1:]}:{f.lineno})"


def collective_failure(exc: BaseException) -> str | None:
    """One line naming this rank and the Megatron operation that failed, for a backend error that
    says a peer is gone or a deadline passed; None for Piper's own errors (complete already) and for
    anything else."""
    if isinstance(exc, CollectiveError) or not isinstance(exc, RuntimeError):
        return None
    kind = kind_of(exc)
    if kind == "failed":
        return None
    rank, world = _rank_and_world()
    what = ("lost a peer (a rank exited, crashed or was killed; the first error in the job's logs names it)"
            if kind == "peer gone" else "timed out waiting for a peer (a rank hangs or skipped the call)")
    return (f"piper_megatron: rank {rank} of {world} stopped in {_megatron_frame(exc)}, a collective of "
            f"Megatron's: it {what}: {type(exc).__name__}: {first_line(exc)}")
