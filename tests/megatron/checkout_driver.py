"""Subprocess side of tests/megatron/test_versions.py: what a real Megatron-LM checkout's
``megatron.training`` (the core_v0.16.1 one beside the repository) says of the facts
:mod:`piper_megatron.versions` records for its release, written as JSON.

Run as ``python -m tests.megatron.checkout_driver OUT.json ARGS...`` with the checkout first on
PYTHONPATH: ARGS are parsed by the checkout's own parser, and its own tokenizer builder pads the
vocabulary they describe (``build_tokenizer`` sets ``args.padded_vocab_size``, as
``set_global_variables`` does before the model is built).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(out_path: str, argv: list[str]) -> None:
    from piper_megatron.cpu_training import install_megatron_lm_cpu_shims

    install_megatron_lm_cpu_shims()  # the triton stand-in megatron.training.initialize needs on CPU
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    from megatron.training.tokenizer import build_tokenizer

    from piper_megatron.versions import installed_release
    from tests.megatron.args_driver import parser_defaults

    found = installed_release()
    ns = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)
    ns.rank = 0
    build_tokenizer(ns)
    result = {"series": found.series, "entry": found.entry,
              "parse_and_validate_args": hasattr(arguments, "parse_and_validate_args"),
              "initialize_binds_validate_args": getattr(initialize, "validate_args", None) is arguments.validate_args,
              "padded_vocab_size": ns.padded_vocab_size, "parser_defaults": parser_defaults()}
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
