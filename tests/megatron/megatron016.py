"""A stand-in for the argument API of megatron-core 0.16 and 0.17 (Megatron-LM tags core_v0.16.1,
core_v0.17.0 and core_v0.17.1: ``initialize.py`` and ``training.py`` reach validation the same way in
each), used ONLY because the real ``megatron.training`` of those releases cannot be installed here
next to the 0.19.2 tree: the megatron-core 0.16.1 wheel ships ``megatron/core`` alone (the checkout
tests/megatron/test_pretrain_gpt.py runs is 0.16.1's whole), and 0.17 needs Python 3.12.

Built on the REAL ``megatron.training.arguments`` of 0.19.2 (:mod:`tests.megatron.megatron_wheel`):
its parser, ``add_megatron_arguments``, ``parse_args`` and ``validate_args`` are used unchanged (and
its tokenizers: the NullTokenizer of 0.16-0.17 would add one end-of-document token). What is emulated
is how 0.16 and 0.17 reach them, read from core_v0.16.1 (the same at core_v0.17.1):

* ``megatron/training/initialize.py`` does ``from megatron.training.arguments import parse_args,
  validate_args`` at import, and ``initialize_megatron(extra_args_provider=None, args_defaults={},
  ignore_unknown_args=False, ...)`` calls ``parse_args(extra_args_provider, ignore_unknown_args)``,
  then ``validate_args(args, args_defaults)``, then ``set_global_variables(args)`` (distributed
  set-up follows there; not emulated). Hooking ``arguments.validate_args`` alone therefore misses it:
  the name bound at import must be replaced too, which is what this stand-in lets a test check.
* ``megatron/training/training.py`` imports ``initialize_megatron`` by name, and
  ``pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
  process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, ...)`` starts with
  ``initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults)``
  (the model is built after that; not emulated: the stand-in returns the validated args).
* ``megatron.core.package_info.__version__`` reads the version given (0.16.1 or 0.17.1), so version
  detection picks the ``pretrain`` entry (:mod:`piper_megatron.versions`).
"""

from __future__ import annotations

import sys
import types

_INITIALIZE = '''
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import set_global_variables


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False,
                        allow_no_cuda=False, skip_mpu_initialization=False, get_embedding_ranks=None,
                        get_position_embedding_ranks=None, parsed_args=None, store=None):
    args = parse_args(extra_args_provider, ignore_unknown_args) if parsed_args is None else parsed_args
    validate_args(args, args_defaults)
    set_global_variables(args)
    return args
'''

_TRAINING = '''
from megatron.training.initialize import initialize_megatron


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={},
             get_embedding_ranks=None, get_position_embedding_ranks=None, non_loss_data_func=None,
             store=None, inprocess_call_wrapper=None):
    return initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
'''


def _module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = f"<megatron 0.16 stand-in: {name}>"
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # binds names at import, as 0.16 does
    return module


def install_standin(version: str = "0.16.1") -> None:
    """Make ``megatron.training`` look like that of ``version`` (0.16 or 0.17) to a script and to
    version detection."""
    import megatron.core.package_info as info
    import megatron.training as training

    info.__version__ = version
    initialize = _module("megatron.training.initialize", _INITIALIZE)
    sys.modules["megatron.training.initialize"] = initialize
    training.initialize = initialize
    training.initialize_megatron = initialize.initialize_megatron
    stand_in_training = _module("megatron.training.training_016", _TRAINING)
    training.pretrain = stand_in_training.pretrain
