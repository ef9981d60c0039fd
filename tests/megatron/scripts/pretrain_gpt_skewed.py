"""Megatron-LM's own ``pretrain_gpt.py`` (the file ``$PIPER_PRETRAIN_GPT`` names), with a fixed bias on
the router logits of logical experts 0 and 1 in every MoE layer (:func:`piper_megatron.experts.
bias_routers`, the CPU trainer's ``router_bias``), both on expert-parallel rank 0 under Megatron's
placement: routing is skewed by a known amount, so that moving experts pays
(tests/megatron/test_pretrain_migrate.py). Only ``get_model``'s result is touched: the bias is a
constant added to the logits, not a parameter. The script's directory must be on ``PYTHONPATH``
(``megatron.training`` is the checkout's, as when ``pretrain_gpt.py`` runs itself)."""

import os
import runpy
import sys

from megatron.training import training

from piper_megatron.experts import bias_routers

BIAS = {0: 0.5, 1: 0.5}


def _biased(get_model):
    def get_model_with_biased_routers(*args, **kwargs):
        model = get_model(*args, **kwargs)
        bias_routers(model, BIAS)
        return model

    return get_model_with_biased_routers


if __name__ == "__main__":
    script = os.environ["PIPER_PRETRAIN_GPT"]
    training.get_model = _biased(training.get_model)
    sys.argv[0] = script
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
