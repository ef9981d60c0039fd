"""Piper's Megatron-Core adapter.

Submodules import Megatron-Core themselves; importing this package does not, so ``piper_core`` users
without Megatron installed can still import ``piper_megatron`` names lazily. ``piper_megatron.build``
builds Megatron modules from Piper specs; ``piper_megatron.cpu`` (tests and CPU demos only) lets
Megatron-Core MoE run on CPU with gloo. ``python -m piper_megatron SCRIPT ... --piper`` runs a
Megatron-LM pretraining script with Piper; :func:`install` does the same for a script you own.
"""

from piper_megatron.install import install

__all__ = ["install"]
