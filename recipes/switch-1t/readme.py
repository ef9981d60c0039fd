"""Fill the switch-1t README's generated parts from ``generated/outputs`` (run by regenerate.sh).

    python recipes/switch-1t/readme.py          # rewrites README.md in place

Three kinds of marked regions are replaced, so every figure in them is a command's real output:
``<!-- begin output: FILE -->`` ... ``<!-- end output -->`` gets FILE's text in a fenced block;
``<!-- begin comparison -->`` ... ``<!-- end comparison -->`` a table of the best plan Megatron-LM runs
with ``--piper`` and the best stock Megatron-LM runs, per target, from the "by runtime" lines of one
``piper plan`` search each, with why ``--piper`` is or is not faster; ``<!-- begin summary -->`` ...
``<!-- end summary -->`` a table of what the launchers pick, from the ``best:`` and ``predicted`` lines
of their outputs. Text outside the markers is left alone.
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
COMPARISON = re.compile(r"(<!-- begin comparison -->\n).*?(<!-- end comparison -->)", re.S)
BEST = re.compile(r"best: (?P<plan>.+)\n\s+predicted MFU (?P<mfu>[\d.]+%) \((?P<tflops>\d+) TFLOPS/GPU, "
                  r"(?P<tokens>[\d,]+) tokens/s\), step (?P<step>[\d.]+) s, peak memory (?P<peak>[\d.]+) of "
                  r"(?P<cap>[\d.]+) GiB\n\s+bottleneck: (?P<bottleneck>.+)")


RUNTIME = re.compile(r"^  (?P<name>Megatron --piper|Megatron stock|DeepSpeed piper|DeepSpeed stock) +"
                     r"(?:none: (?P<none>.+)|(?P<plan>\S.*?) +(?P<mfu>[\d.]+%) +(?P<step>[\d.]+) +(?P<a2a>[\d.]+%))$", re.M)
VERSUS = re.compile(r"^  Megatron-LM: (?P<why>.+)$", re.M)


def _row(cluster: str, gpus: int, framework: str, source: str, text: str) -> str:
    m = BEST.search(text)
    if m is None:
        return f"| {cluster} | {gpus} | {framework} | no plan fits (`{source}`) | | | | | |"
    return (f"| {cluster} | {gpus} | {framework} | `{m['plan']}` | {m['mfu']} | {m['step']} s | {m['tokens']} | "
            f"{m['peak']} / {m['cap']} | {m['bottleneck']} |")


def _runtime(text: str, name: str) -> str:
    """``plan`` | MFU | step cells of one runtime's line in a ``piper plan`` output."""
    for m in RUNTIME.finditer(text):
        if m["name"] == name:
            if m["none"]:
                return f"none ({m['none']}) | | "
            return f"`{m['plan']}` | {m['mfu']} | {m['step']} s "
    return "no plan fits | | "


def comparison(outputs: Path = OUTPUTS) -> str:
    """Per (cluster, GPUs): the best plan Megatron-LM runs with ``--piper`` and the best plan stock
    Megatron-LM runs, both from the same ``piper plan`` search (its "by runtime" lines), and why."""
    rows = ["| cluster | GPUs | Megatron-LM `--piper`: best plan | MFU | step | stock Megatron-LM: best plan | MFU | "
            "step | `--piper` vs stock |",
            "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | --- |"]
    for cluster, gpus in TARGETS:
        text = (outputs / f"plan-{cluster}-{gpus}.txt").read_text()
        versus = VERSUS.search(text)
        why = versus["why"] if versus else "no plan fits either"
        rows.append(f"| {cluster} | {gpus} | {_runtime(text, 'Megatron --piper')}| "
                    f"{_runtime(text, 'Megatron stock')}| {why} |")
    return "\n".join(rows) + "\n"


def summary(outputs: Path = OUTPUTS) -> str:
    rows = ["| cluster | GPUs | launcher | plan | MFU | step | tokens/s | peak / usable GiB | bottleneck |",
            "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for cluster, gpus in TARGETS:
        for framework, kind in (("Megatron-LM `--piper` (`megatron.sh`)", "megatron"),
                                ("DeepSpeed (`deepspeed_plan.py`)", "deepspeed")):
            name = f"{kind}-{cluster}-{gpus}.txt"
            rows.append(_row(cluster, gpus, framework, f"generated/outputs/{name}", (outputs / name).read_text()))
    return "\n".join(rows) + "\n"


def render(readme: str, outputs: Path = OUTPUTS) -> str:
    """``readme`` with every marked region refilled from ``outputs``."""
    def block(m: re.Match[str]) -> str:
        text = (outputs / m["name"]).read_text()
        return f"{m.group(1)}```text\n{text.rstrip()}\n```\n{m.group(3)}"

    readme = BLOCK.sub(block, readme)
    readme = COMPARISON.sub(lambda m: f"{m.group(1)}{comparison(outputs)}{m.group(2)}", readme)
    return SUMMARY.sub(lambda m: f"{m.group(1)}{summary(outputs)}{m.group(2)}", readme)


def main() -> int:
    path = HERE / "README.md"
    path.write_text(render(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
