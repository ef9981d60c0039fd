"""Every command output quoted in the files docs/refresh.py keeps (``FILES``: README.md and the docs
pages whose figures come from commands; ``<!-- run: CMD -->`` and ``<!-- run-md: CMD -->`` blocks) is
what CMD prints today,
up to the search's time and rate: a model change that moves a figure makes the quote stale and this
test red until ``python docs/refresh.py`` rewrites it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _refresh():
    spec = importlib.util.spec_from_file_location("docs_refresh", ROOT / "docs" / "refresh.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", _refresh().FILES)
def test_quoted_outputs_are_current(name):
    refresh = _refresh()
    text = (ROOT / name).read_text()
    marks = sum(len(mark.findall(text)) for mark in (*refresh.MARKS, refresh.BLOCKS))
    assert marks >= 1, f"{name} lost its quoted command outputs"
    stale = refresh.stale(text)
    assert not stale, "\n".join(f"stale: {cmd}\n--- quoted\n{quoted}--- now\n{now}" for cmd, quoted, now in stale)


def test_the_pages_with_command_figures_are_all_kept():
    assert {"README.md", "docs/megatron.md", "docs/e2e.md", "docs/validation.md"} <= set(_refresh().FILES)


def test_a_block_the_page_lacks_is_stale():
    """check-blocks: every block the command prints must be in the page; one missing fails."""
    refresh = _refresh()
    page = "<!-- check-blocks: printf 'a\\n\\nb\\n' -->\n\nprose\n\na\n\nmore prose\n\nb\n"
    assert refresh.stale(page) == []
    assert [block for _, _, block in refresh.stale(page.replace("\nb\n", "\nc\n"))] == ["b\n"]


def test_masking_hides_only_the_search_time():
    refresh = _refresh()
    a = "searched 1,234 plans in 0.52 s (2,373 plans/s): 9 feasible"
    b = "searched 1,234 plans in 0.61 s (2,023 plans/s): 9 feasible"
    assert refresh.mask(a) == refresh.mask(b)
    assert refresh.mask(a) != refresh.mask(a.replace("1,234", "1,235"))


# docs/refresh.py quotes what a user sees: standard output, then standard error (an error such as a
# plan that does not fit goes to stderr; a quote of stdout alone was empty), whatever the exit status.

def test_a_quote_holds_stdout_then_stderr_of_a_failing_command():
    refresh = _refresh()
    cmd = "python -c \"import sys; print('planned'); print('error: no plan', file=sys.stderr); sys.exit(1)\""
    assert refresh.run(cmd) == "planned\nerror: no plan\n"
    assert refresh.run("python -c \"import sys; print('only an error', file=sys.stderr); sys.exit(2)\"") == \
        "only an error\n"
    assert refresh.run("python -c \"print('ok')\"") == "ok\n"


def test_the_infeasible_example_in_megatron_md_is_not_empty():
    refresh = _refresh()
    quotes = [m for m in refresh.MARKS[0].finditer((ROOT / "docs" / "megatron.md").read_text())
              if "--piper-world-size 8" in m["cmd"]]
    assert len(quotes) == 1
    assert quotes[0]["out"].startswith("piper_megatron: infeasible: no plan for gpt-24L-4096H-512E-top1 fits 8 GPUs")


def test_a_markdown_quote_is_replaced_between_its_markers_only():
    refresh = _refresh()
    text = "prose\n<!-- run-md: python -c \"print('| a |')\" -->\n| old |\n<!-- end run-md -->\nmore prose\n"
    assert refresh.refresh(text) == text.replace("| old |", "| a |")
    assert [cmd for cmd, _, _ in refresh.stale(text)] == ["python -c \"print('| a |')\""]
