"""Fill the switch-1t README's generated parts from ``generated/outputs`` (run by regenerate.sh).

    python recipes/switch-1t/readme.py          # rewrites README.md in place

Two kinds of marked regions are replaced, so every figure in them is a command's real output:
``<!-- begin output: FILE -->`` ... ``<!-- end output -->`` gets FILE's text in a fenced block, and
``<!-- begin summary -->`` ... ``<!-- end summary -->`` a table built from the ``best:`` and
``predicted`` lines of the plan outputs. Text outside the markers is left alone.
tests/unit/test_recipe_files.py checks that :func:`render` leaves the committed README unchanged.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTPUTS = HERE / "generated" / "outputs"
TARGETS = (("dgx-h100", 64), ("dgx-h100", 1024), ("frontier", 64), ("frontier", 256), ("frontier", 1024))
BLOCK = re.compile(r"(<!-- begin output: (?P<name>[\w.-]+) -->\n).*?(<!-- end output -->)", re.S)
SUMMARY = re.compile(r"(<!-- begin summary -->\n).*?(<!-- end summary -->)", re.S)
BEST = re.compile(r"best: (?P<plan>.+)\n\s+predicted MFU (?P<mfu>[\d.]+%) \((?P<tflops>\d+) TFLOPS/GPU, "
                  r"(?P<tokens>[\d,]+) tokens/s\), step (?P<step>[\d.]+) s, peak memory (?P<peak>[\d.]+) of "
                  r"(?P<cap>[\d.]+) GiB\n\s+bottleneck: (?P<bottleneck>.+)")


def _row(cluster: str, gpus: int, framework: str, source: str, text: str) -> str:
    m = BEST.search(text)
    if m is None:
        return f"| {cluster} | {gpus} | {framework} | no plan fits (`{source}`) | | | | | |"
    return (f"| {cluster} | {gpus} | {framework} | `{m['plan']}` | {m['mfu']} | {m['step']} s | {m['tokens']} | "
            f"{m['peak']} / {m['cap']} | {m['bottleneck']} |")


def summary(outputs: Path = OUTPUTS) -> str:
    rows = ["| cluster | GPUs | framework | plan | MFU | step | tokens/s | peak / usable GiB | bottleneck |",
            "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for cluster, gpus in TARGETS:
        for framework, kind in (("Megatron-LM `--piper`", "megatron"), ("stock Megatron-LM (`piper plan`)", "plan"),
                                ("DeepSpeed", "deepspeed")):
            name = f"{kind}-{cluster}-{gpus}.txt"
            rows.append(_row(cluster, gpus, framework, f"generated/outputs/{name}", (outputs / name).read_text()))
    return "\n".join(rows) + "\n"


def render(readme: str, outputs: Path = OUTPUTS) -> str:
    """``readme`` with every marked region refilled from ``outputs``."""
    def block(m: re.Match[str]) -> str:
        text = (outputs / m["name"]).read_text()
        return f"{m.group(1)}```text\n{text.rstrip()}\n```\n{m.group(3)}"

    readme = BLOCK.sub(block, readme)
    return SUMMARY.sub(lambda m: f"{m.group(1)}{summary(outputs)}{m.group(2)}", readme)


def main() -> int:
    path = HERE / "README.md"
    path.write_text(render(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
