"""Stands for Megatron-LM's pretrain_gpt.py on the 0.17-0.19 API: its ``__main__`` parses and
validates the arguments the way the real script does (``parse_and_validate_args`` with the same
``args_defaults``); the real script builds the model and trains after that point."""

import sys

from tests.megatron.scripts import probe

probe.starts.append(sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron.")))

from megatron.training.arguments import parse_and_validate_args  # noqa: E402

if __name__ == "__main__":
    args = parse_and_validate_args(extra_args_provider=None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
