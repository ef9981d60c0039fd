"""Stands for Megatron-LM's pretrain_gpt.py on the 0.16 API: its ``__main__`` calls
``pretrain(..., args_defaults=..., extra_args_provider=...)``, which parses and validates the
arguments inside ``initialize_megatron`` (tests/megatron/megatron016.py); the real ``pretrain``
builds the model and trains after that point."""

import sys

from tests.megatron.scripts import probe

probe.starts.append(sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron.")))

from megatron.training import pretrain  # noqa: E402

if __name__ == "__main__":
    pretrain(None, None, None, None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, extra_args_provider=None)
