"""DeepSpeed tier: Piper's DeepSpeed adapter against stock DeepSpeed-MoE, on gloo CPU processes.

:func:`deepspeed_comm` is what every rank function calls first (inside :func:`tests.gloo.run_ranks`,
whose process group already exists): it gives ``deepspeed.comm`` its backend object without building
DeepSpeed's shared-memory all-reduce op. DeepSpeed's ``TorchBackend`` compiles that op with g++ on
first use (~25 s, then cached in ~/.cache/torch_extensions); it serves only ``inference_all_reduce``,
which training never calls, so the tests skip it rather than pay the compile on a fresh machine.
"""

from __future__ import annotations


def deepspeed_comm() -> None:
    """Initialise ``deepspeed.comm`` over the existing torch.distributed group (no shm op build)."""
    from piper_deepspeed.measure import init_deepspeed_comm

    init_deepspeed_comm()
