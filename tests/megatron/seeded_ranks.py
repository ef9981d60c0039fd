"""Rank side for tests that compare plans which split one model differently: Piper's Megatron-Core
trainer with every weight drawn from a generator seeded by the weight's global name (its layer's
global number, not its index on the rank), so that every plan starts from the same model."""

from __future__ import annotations

import re
import zlib
from typing import Any


def _global_names(chunk: Any) -> dict[str, Any]:
    layers = {name: mod.layer_number for name, mod in chunk.named_modules()
              if re.fullmatch(r"(.*\.)?decoder\.layers\.\d+", name) and hasattr(mod, "layer_number")}
    out = {}
    for name, p in chunk.named_parameters():
        key = name
        for prefix, number in layers.items():
            if name.startswith(prefix + "."):
                key = f"layer{number}." + name[len(prefix) + 1:]
        out[key] = p
    return out


def seed_by_name(chunk: Any) -> None:
    import torch

    for key, p in _global_names(chunk).items():
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        with torch.no_grad():
            if p.dim() == 1:  # norm weights around 1, biases small
                p.copy_((1.0 if "norm" in key else 0.0) + 0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def rank_main(info: Any, job_json: dict[str, Any]) -> dict[str, Any]:
    import piper_megatron.build as build
    from piper_megatron import train

    real = build.gpt_model_chunks

    def chunks(*args: Any, **kwargs: Any) -> list[Any]:
        built = real(*args, **kwargs)
        for c in built:
            seed_by_name(c)
        return built

    build.gpt_model_chunks = chunks  # the trainer imports it at run time
    return train.rank_main(info, job_json)
