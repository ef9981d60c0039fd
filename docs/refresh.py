"""Keep the command outputs quoted in the docs equal to what the commands print today.

    python docs/refresh.py            # rerun every marked command, rewrite the files in place
    python docs/refresh.py --check    # exit 1 and show the first difference when a quote is stale

A quoted output is marked in the Markdown like this, and only the fenced block after the marker is
replaced (text around it is prose and is left alone)::

    <!-- run: piper predict switch-1t --cluster dgx-h100 --gpus 1024 --parallel "ep=512" -->
    ```text
    ...what the command printed...
    ```

A command that prints Markdown (a table meant to render) is marked with a pair of comments instead,
and everything between them is replaced::

    <!-- run-md: python -m piper_core.bench.e2e_report docs/e2e/*steps.json --headline -->
    | case | ... |
    <!-- end run-md -->

A page whose prose interleaves a command's tables (each table introduced and discussed where it is
read) is marked once, anywhere in it; every block of the command's output (blocks are separated by
blank lines) must then appear verbatim somewhere in the page. Such quotes are checked, not
rewritten: a stale one fails ``--check`` and a rewrite names it for a person to update::

    <!-- check-blocks: python -m piper_core.bench.alltoall_report docs/alltoall/results.json -->

Commands run from the repository root with ``.venv/bin`` first on PATH. The quote is what a user
sees in a terminal: standard output, then standard error (where errors such as a plan that does
not fit are printed), whatever the exit status. Search times and rates
(``searched N plans in X s (Y plans/s)``) vary from run to run and are masked when checking; every
other figure must match. Outputs that take minutes to produce (training, calibration, validation)
are quoted with ``<!-- measured: COMMAND -->`` instead: recorded once, with the command, not rerun.
``tests/unit/test_docs_current.py`` checks every file of :data:`FILES`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("README.md", "docs/megatron.md", "docs/e2e.md", "docs/validation.md", "docs/published.md", "docs/deepspeed.md",
         "docs/alltoall.md", "docs/clusters.md",
         "docs/fp8.md", "docs/layouts.md", "docs/routing.md", "docs/migration.md", "docs/placement-bench.md")
MARKS = (re.compile(r"(<!-- run: (?P<cmd>.+?) -->\n```text\n)(?P<out>.*?)(```)", re.S),
         re.compile(r"(<!-- run-md: (?P<cmd>.+?) -->\n)(?P<out>.*?)(<!-- end run-md -->)", re.S))
BLOCKS = re.compile(r"<!-- check-blocks: (?P<cmd>.+?) -->")
VARIES = (re.compile(r"searched ([\d,]+) plans in [\d.]+ s \([\d,]+ plans/s\)"),)


def run(cmd: str) -> str:
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONWARNINGS": "ignore", "COLUMNS": "200"}
    proc = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    streams = [s.rstrip() for s in (proc.stdout, proc.stderr) if s.strip()]
    return "\n".join(streams) + "\n"


def mask(text: str) -> str:
    for pattern in VARIES:
        text = pattern.sub(lambda m: f"searched {m[1]} plans in <t> s (<rate> plans/s)", text)
    return text


def refresh(text: str) -> str:
    for mark in MARKS:
        text = mark.sub(lambda m: m[1] + run(m["cmd"]) + m[4], text)
    return text


def stale(text: str) -> list[tuple[str, str, str]]:
    """(command, quoted, printed now) for every quote that differs beyond the masked figures."""
    out = []
    for m in (m for mark in MARKS for m in mark.finditer(text)):
        now = run(m["cmd"])
        if mask(now) != mask(m["out"]):
            out.append((m["cmd"], m["out"], now))
    return out + missing_blocks(text)


def missing_blocks(text: str) -> list[tuple[str, str, str]]:
    """(command, "", block) for every block a ``check-blocks`` command prints that the page lacks."""
    out, body = [], mask(BLOCKS.sub("", text))  # the marks themselves are not quotes
    for m in BLOCKS.finditer(text):
        for block in (b.strip() for b in run(m["cmd"]).split("\n\n")):
            if block and mask(block) not in body:
                out.append((m["cmd"], "", block + "\n"))
    return out


def main(argv: list[str]) -> int:
    check = "--check" in argv
    bad = 0
    for name in FILES:
        path = ROOT / name
        text = path.read_text()
        if check:
            for cmd, quoted, now in stale(text):
                bad += 1
                print(f"{name}: stale output of `{cmd}`" + (f"; the page lacks the block starting "
                      f"{now.splitlines()[0]!r}" if not quoted else ""), file=sys.stderr)
                for a, b in zip(mask(quoted).splitlines(), mask(now).splitlines()):
                    if a != b:
                        print(f"  quoted: {a}\n  now:    {b}", file=sys.stderr)
                        break
        else:
            path.write_text(refresh(text))
            for cmd, _, block in missing_blocks(text):  # checked, not rewritten: a person places them
                bad += 1
                print(f"{name}: `{cmd}` prints a block the page lacks; update the page:\n{block}", file=sys.stderr)
    if bad:
        print("run `python docs/refresh.py` to update", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
