"""Subprocess side of tests/megatron/test_piper_args.py: ``--piper`` through a real Megatron argument
API, scenario by scenario, results written as JSON.

Run as ``python -m tests.megatron.args_driver VERSION SCENARIOS.json OUT.json`` with megatron-core
0.19.2's tree first on PYTHONPATH (tests/megatron/megatron_wheel.py). VERSION 0.19.2 uses that tree
as it is; an older one (0.16.1, 0.17.1: the releases whose scripts reach validation through
``pretrain``) first installs tests/megatron/megatron016.py's stand-in reporting that version. Each scenario
runs a stand-in ``pretrain_gpt.py`` (tests/megatron/scripts) either through the launcher
(``piper_megatron.__main__.main``) or through ``piper_megatron.install()`` + ``runpy``, then reports
what Megatron validated (its global args), the ``piper:`` lines printed, the exit or error, whether
the hooks were in place, and whether every hooked module attribute is the original object again
after ``restore()`` (or after a run without ``--piper``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

REPORTED = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
            "micro_batch_size", "global_batch_size", "recompute_granularity", "recompute_method",
            "recompute_num_layers", "use_distributed_optimizer", "moe_token_dispatcher_type", "grad_reduce_in_bf16",
            "optimizer_cpu_offload", "decoder_last_pipeline_num_layers", "data_parallel_size", "piper",
            "piper_cluster", "padded_vocab_size", "overlap_grad_reduce", "overlap_param_gather")
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _modules() -> dict[str, Any]:
    import megatron.core.parallel_state as parallel_state
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    return {"arguments": arguments, "initialize": initialize, "parallel_state": parallel_state,
            "moe_layer": moe_layer, "token_dispatcher": token_dispatcher, "MoELayer": moe_layer.MoELayer}


def snapshot() -> dict[str, dict[str, int]]:
    """id() of every attribute of the modules (and the class) Piper may hook."""
    return {name: {k: id(v) for k, v in vars(obj).items()} for name, obj in _modules().items()}


def changed(before: dict[str, dict[str, int]]) -> list[str]:
    now = snapshot()
    return sorted(f"{name}.{k}" for name in before for k in set(before[name]) | set(now[name])
                  if before[name].get(k) != now[name].get(k))


def hooks() -> dict[str, bool]:
    m = _modules()
    return {"arguments.validate_args": hasattr(m["arguments"].validate_args, "__wrapped__"),
            "initialize.validate_args": hasattr(getattr(m["initialize"], "validate_args", None), "__wrapped__"),
            "parallel_state.initialize_model_parallel": hasattr(m["parallel_state"].initialize_model_parallel,
                                                                "__wrapped__")}


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def run_scenario(script: Path, scenario: dict[str, Any]) -> dict[str, Any]:
    from megatron.training import global_vars

    from piper_megatron.__main__ import main
    from piper_megatron.install import install

    global_vars.unset_global_variables()
    for key in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    os.environ.update(scenario.get("env", {}))
    argv, out, result = list(scenario["argv"]), io.StringIO(), {}
    installation = None
    try:
        with contextlib.redirect_stdout(out):
            if scenario["via"] == "launcher":
                result["rc"] = main([str(script), *argv])
            else:
                installation = install(argv, out=out)
                result["installed"] = installation is not None
                result["install_again_is_same"] = install(argv, out=out) is installation
                sys.argv = [str(script), *argv]
                runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        result["exit"] = exc.code
    except Exception as exc:  # reported to the test, which decides
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["stdout"] = out.getvalue()
    result["piper_lines"] = [line for line in out.getvalue().splitlines() if line.startswith("piper")]
    args = global_vars._GLOBAL_ARGS
    result["args"] = None if args is None else {k: _plain(getattr(args, k, None)) for k in REPORTED}
    result["hooks"] = hooks()
    if installation is not None:
        installation.restore()
    return result


def parser_defaults() -> dict[str, Any]:
    """Defaults of the real parser (pristine add_megatron_arguments) for every dest."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return {a.dest: _plain(getattr(a.default, "name", a.default)) for a in parser._actions}


def main(version: str, scenarios_path: str, out_path: str) -> None:
    import megatron.core.package_info as info

    if version != info.__version__:
        from tests.megatron.megatron016 import install_standin

        install_standin(version)
    from piper_megatron.versions import drift, installed_release

    found = installed_release()
    script = SCRIPTS / ("pretrain_gpt_016.py" if found.entry == "pretrain" else "pretrain_gpt_019.py")
    pristine = snapshot()
    results: dict[str, Any] = {"detected": {"series": found.series, "entry": found.entry}, "drift": drift(),
                               "parser_defaults": parser_defaults(), "scenarios": {}}
    for name, scenario in json.loads(Path(scenarios_path).read_text()).items():
        result = run_scenario(script, scenario)
        result["changed_after"] = changed(pristine) if scenario["via"] != "launcher" or "--piper" not in \
            scenario["argv"] else None
        results["scenarios"][name] = result
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
