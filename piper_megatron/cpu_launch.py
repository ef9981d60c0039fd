"""``python -m piper_megatron.cpu_launch SCRIPT [Megatron arguments] [--piper ...]``: run a
Megatron-LM training script on CPU ranks over gloo, for tests and CPU demos.

Exactly ``python -m piper_megatron SCRIPT ARGS`` (:mod:`piper_megatron.__main__`: the same
``sys.argv``, the script's directory first on ``sys.path``, ``--piper`` hooked when given), after
:func:`piper_megatron.cpu_training.install_megatron_lm_cpu_shims` has redirected Megatron's CUDA
calls to the host. Launch it on local ranks with torchrun::

    torchrun --standalone --nproc-per-node 2 -m piper_megatron.cpu_launch Megatron-LM/pretrain_gpt.py \\
        <model and data arguments> --distributed-backend gloo --transformer-impl local ... --piper --piper-cluster cpu-local

The CPU needs Megatron's local (non-Transformer-Engine, unfused) code paths, so the command line
must carry :data:`CPU_FLAGS`; a command without them is refused with the list. The shims are for
CPUs only: never use this entry point on GPUs (``python -m piper_megatron`` is the launcher there).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from piper_core.errors import SpecError

# Flags without which Megatron takes a CUDA-only path on CPU ranks, or --piper prices kernels the CPU
# does not run (flag, why). Checked on core_v0.16.1; the fused bias-GeLU/dropout-add and the default
# (on-device) initialisation run on the host as they are.
CPU_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--distributed-backend", "gloo"), "NCCL needs GPUs"),
    (("--transformer-impl", "local"), "Transformer Engine is a CUDA library"),
    (("--no-gradient-accumulation-fusion",), "the fused weight-gradient GEMM is an Apex CUDA extension"),
    (("--no-persist-layer-norm",), "the persistent LayerNorm is Apex's CUDA kernel (torch norms refuse it)"),
    (("--no-masked-softmax-fusion",), "in bf16/fp16 the fused softmax is a CUDA kernel"),
    (("--no-rope-fusion",), "the fused RoPE is Transformer Engine's (TransformerConfig refuses it without TE)"),
    (("--attention-backend", "unfused"), "the local layers run Megatron's unfused DotProductAttention, and "
     "--piper prices flash attention otherwise"),
)
USAGE = "usage: python -m piper_megatron.cpu_launch SCRIPT [Megatron arguments] [--piper ...] (under torchrun)"


def missing_cpu_flags(args: Sequence[str]) -> list[str]:
    """The :data:`CPU_FLAGS` absent from ``args`` (``--flag value`` or ``--flag=value``)."""
    args, missing = list(args), []
    for flag, _ in CPU_FLAGS:
        name, value = flag[0], flag[1:]
        given = [args[i + 1] if i + 1 < len(args) else None for i, a in enumerate(args) if a == name]
        given += [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
        if not given or (value and given[-1] != value[0]):
            missing.append(" ".join(flag))
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\nruns SCRIPT as `python -m piper_megatron SCRIPT ARGS` does, after CPU shims for Megatron-LM's "
              "megatron.training (tests and CPU demos only; never on GPUs); ARGS must include "
              + " ".join(" ".join(flag) for flag, _ in CPU_FLAGS), file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    from piper_megatron.__main__ import main as launch
    from piper_megatron.args import parse_piper_options

    script, args = argv[0], argv[1:]
    try:
        options = parse_piper_options(args)
        if not (options.enabled and options.plan_only):  # plan-only runs nothing: no shims, no flags
            missing = missing_cpu_flags(args)
            if missing:
                raise SpecError("CPU flags", "missing", "on CPU ranks Megatron must take its local, unfused code "
                                "paths (" + "; ".join(f"{' '.join(f)}: {why}" for f, why in CPU_FLAGS) + ")",
                                "add " + " ".join(missing))
            _install(script)
    except SpecError as exc:
        print(f"piper_megatron.cpu_launch: error: {exc}", file=sys.stderr)
        return 2
    return launch(argv)


def _install(script: str) -> None:
    from piper_megatron.cpu_training import install_megatron_lm_cpu_shims

    path = Path(script)
    if path.is_file():  # the launcher does the same before running it: megatron.training comes from there
        sys.path[0] = str(path.resolve().parent)
    try:
        install_megatron_lm_cpu_shims()
    except ModuleNotFoundError as exc:
        raise SpecError("megatron.training", "not importable", f"the CPU shims patch Megatron-LM's training loop "
                        f"({exc})", "pass the pretrain_gpt.py of a Megatron-LM checkout (its directory goes first "
                        "on sys.path), e.g. core_v0.16.1 for megatron-core 0.16.1") from exc
    if os.environ.get("RANK", "0") == "0":
        print("piper: CPU shims installed (piper_megatron.cpu_training): Megatron's CUDA calls run on the host, "
              "for tests and CPU demos only", flush=True)


if __name__ == "__main__":
    sys.exit(main())
