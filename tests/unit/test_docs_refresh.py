"""docs/refresh.py quotes what a user sees: standard output, then standard error (an error such as a
plan that does not fit goes to stderr; a quote of stdout alone was empty), whatever the exit status."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _refresh():
    spec = importlib.util.spec_from_file_location("docs_refresh", ROOT / "docs" / "refresh.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_quote_holds_stdout_then_stderr_of_a_failing_command():
    refresh = _refresh()
    cmd = "python -c \"import sys; print('planned'); print('error: no plan', file=sys.stderr); sys.exit(1)\""
    assert refresh.run(cmd) == "planned\nerror: no plan\n"
    assert refresh.run("python -c \"import sys; print('only an error', file=sys.stderr); sys.exit(2)\"") == \
        "only an error\n"
    assert refresh.run("python -c \"print('ok')\"") == "ok\n"


def test_the_infeasible_example_in_megatron_md_is_not_empty():
    refresh = _refresh()
    quotes = [m for m in refresh.MARK.finditer((ROOT / "docs" / "megatron.md").read_text())
              if "--piper-world-size 8" in m["cmd"]]
    assert len(quotes) == 1
    assert quotes[0]["out"].startswith("piper_megatron: infeasible: no plan for gpt-24L-4096H-512E-top1 fits 8 GPUs")
