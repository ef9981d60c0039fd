"""DeepSpeed adapter: the ``"piper"`` config block and Piper's all-to-all inside DeepSpeed-MoE.

* :func:`initialize` -- drop-in for ``deepspeed.initialize``: reads the ``"piper"`` block, plans for
  the world size, rewrites the batch/ZeRO/pipeline settings, swaps DeepSpeed's MoE layers for
  :class:`PiperMOELayer`; with no block or ``"enabled": false`` DeepSpeed runs untouched.
* :func:`plan_for` -- the same plan without a model or torch.distributed, to build the model for it
  (:func:`build_model`).
* :class:`PiperConfig` -- the block (:mod:`piper_deepspeed.config`).
* ``python -m piper_deepspeed.train`` -- a training script for Switch-style models (docs/deepspeed.md).

Importing this package imports DeepSpeed (``piper_deepspeed.initialize`` must be the function, not
the submodule of the same name, so it is bound here) and installs :mod:`piper_deepspeed.guard`:
plain ``deepspeed.initialize`` then refuses a config with an active ``"piper"`` block instead of
silently ignoring it. Any ``piper_deepspeed.*`` import runs this file first, so every entry point
installs it.
"""

from piper_deepspeed import guard
from piper_deepspeed.builder import build_model
from piper_deepspeed.config import PiperConfig, read_block
from piper_deepspeed.initialize import PlanChoice, PlanOnly, initialize, plan_for
from piper_deepspeed.moe import A2ASettings, PiperMOELayer

guard.install()

__all__ = ["A2ASettings", "PiperConfig", "PiperMOELayer", "PlanChoice", "PlanOnly", "build_model", "initialize",
           "plan_for", "read_block"]
