"""A guard around ``deepspeed.initialize``: a config with an active ``"piper"`` block is refused there.

DeepSpeed keeps unknown top-level config keys silently, so a ``"piper"`` block handed to plain
``deepspeed.initialize`` would be ignored: stock layers, no plan, and ``engine.config["piper"]``
still showing the block as if it had run. Importing :mod:`piper_deepspeed` (any of its modules: the
package ``__init__`` runs first) calls :func:`install`, which replaces the attribute
``deepspeed.initialize`` by a wrapper that raises :class:`SpecError` when the config it would read
(``config``, ``config_params`` or ``args.deepspeed_config``/``deepscale_config``; a dict, a JSON
path or base64, as DeepSpeed loads them) has a ``"piper"`` block that is not ``"enabled": false``.
Otherwise it calls DeepSpeed with the very same arguments.

:func:`piper_deepspeed.initialize` passes the guard because it hands DeepSpeed the rewritten config
*without* the block and puts the block back into ``engine.config`` afterwards; the guard needs no
notion of who is calling.

The only state is the attribute itself: the wrapper carries a marker (:data:`MARK`), so
:func:`install` is idempotent (a second call, or a reload of this module, does not wrap twice) and
:func:`uninstall` restores DeepSpeed's function (``__wrapped__``).

Limits (docs/deepspeed.md): a process that never imports :mod:`piper_deepspeed` runs DeepSpeed
unguarded (DeepSpeed has no plugin hook for config blocks, and a ``.pth``/``sitecustomize`` hook
would run in every Python process of the environment); so does a reference taken before the import
(``from deepspeed import initialize``), and an engine built directly (``DeepSpeedEngine(...)``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import deepspeed
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

from piper_core.errors import SpecError
from piper_deepspeed.config import BLOCK

MARK = "__piper_guard__"  # attribute set on the wrapper, to recognise it


def user_config(args: Any, config: Any, config_params: Any) -> dict[str, Any] | None:
    """The config ``deepspeed.initialize`` would read, loaded as DeepSpeed loads it (None where it
    gets none, or two, which DeepSpeed refuses itself). A path that does not load raises DeepSpeed's
    own error (``load_ds_config``)."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            return None
        config = from_args
    if config is None:
        return None
    loaded = load_ds_config(config)
    return loaded if isinstance(loaded, dict) else None


def active_block(config: Mapping[str, Any] | None) -> bool:
    """True when ``config`` has a ``"piper"`` block that is not ``"enabled": false``."""
    if config is None or BLOCK not in config:
        return False
    block = config[BLOCK]
    return not (isinstance(block, Mapping) and block.get("enabled") is False)


def refuse_block(config: Mapping[str, Any] | None) -> None:
    """The guard's check: SpecError when ``config`` has an active ``"piper"`` block."""
    if active_block(config):
        raise SpecError(BLOCK, _plain(config[BLOCK]), "deepspeed.initialize ignores the \"piper\" block "
                        "(DeepSpeed keeps unknown config keys silently): the model would run stock, without Piper's "
                        "plan or all-to-all", "call piper_deepspeed.initialize(...) with the same arguments, or set "
                        '"piper": {"enabled": false} to run stock DeepSpeed')


def _plain(value: Any) -> Any:
    """``value`` with hjson's OrderedDicts (a base64 config) as dicts, for a readable message."""
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, Mapping) else value


def _guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)  # same name, doc and signature (inspect follows __wrapped__)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # DeepSpeed's own error for a wrong call
            return original(*args, **kwargs)
        refuse_block(user_config(bound.get("args"), bound.get("config"), bound.get("config_params")))
        return original(*args, **kwargs)

    setattr(initialize, MARK, True)
    return initialize


def installed() -> bool:
    """Whether ``deepspeed.initialize`` is currently the guard."""
    return getattr(deepspeed.initialize, MARK, False) is True


def install() -> None:
    """Wrap ``deepspeed.initialize`` in the guard, unless it already is (idempotent)."""
    if not installed():
        deepspeed.initialize = _guarded(deepspeed.initialize)


def uninstall() -> None:
    """Restore the function the guard wraps (nothing if the guard is not the current attribute)."""
    if installed():
        deepspeed.initialize = deepspeed.initialize.__wrapped__


__all__ = ["MARK", "active_block", "install", "installed", "refuse_block", "uninstall", "user_config"]
