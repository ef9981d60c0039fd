"""Run a Megatron-LM training script on local CPU ranks (torchrun + :mod:`piper_megatron.cpu_launch`)
and read back what it logged: the arguments Megatron validated and, per iteration, the loss and
the time. Used by the real-script test tier and ``make run`` (:mod:`piper_megatron.twin`).

The log is Megatron's own rank-0 output (``megatron/training``, core_v0.16.1): the argument dump
between ``---- arguments ----`` and ``---- end of arguments ----`` (``print_args``), and one
``training_log`` line per ``--log-interval`` iteration, with ``lm loss: {:.6E}`` (7 significant
digits, an average over the interval) and ``elapsed time per iteration (ms): {:.1f}``.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from piper_core.errors import SpecError

CHECKOUT_NAME = "megatron-lm-core_v0.16.1"
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                        r"(?:.*?lm loss: ([\d.E+-]+) \|)?")
_ARG = re.compile(r"^  (\w+) \.+ (.*)$")


class RunFailed(RuntimeError):
    """The script exited with an error or ran past its deadline; the message holds the command and
    the tail of its output (which is where Megatron's and the ranks' tracebacks are)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Iteration:
    """One ``training_log`` line: the iteration (1-based), its wall time and its loss (None when the
    line has none, e.g. a skipped iteration)."""

    iteration: int
    elapsed_ms: float
    lm_loss: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """A finished run: the command, its output, Megatron's validated arguments (as printed: values
    parsed as Python literals where they are, else strings) and the iterations it logged."""

    command: tuple[str, ...]
    stdout: str
    stderr: str
    args: Mapping[str, Any]
    iterations: tuple[Iteration, ...]

    @property
    def losses(self) -> list[float]:
        return [it.lm_loss for it in self.iterations if it.lm_loss is not None]

    @property
    def step_ms(self) -> list[float]:
        return [it.elapsed_ms for it in self.iterations]

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.stdout.splitlines() if line.startswith(prefix)]


def default_checkout(repo: Path) -> Path:
    """Where the project keeps the Megatron-LM checkout beside the repository (``shared/third_party``)."""
    return repo.resolve().parent / "shared" / "third_party" / CHECKOUT_NAME


def find_script(checkout: Path | None, script: str = "pretrain_gpt.py") -> Path | None:
    """``checkout/script`` when it is a file (None otherwise)."""
    if checkout is None:
        return None
    path = Path(checkout) / script
    return path if path.is_file() else None


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_args_dump(stdout: str) -> dict[str, Any]:
    """Megatron's printed arguments (``print_args``), name -> value."""
    args, inside = {}, False
    for line in stdout.splitlines():
        if "---- arguments ----" in line:
            inside = True
        elif "---- end of arguments ----" in line:
            break
        elif inside and (m := _ARG.match(line)):
            args[m[1]] = _value(m[2].strip())
    return args


def parse_iterations(stdout: str) -> tuple[Iteration, ...]:
    """Every ``training_log`` line of ``stdout``, in order."""
    return tuple(Iteration(iteration=int(m[1]), elapsed_ms=float(m[3]), lm_loss=None if m[4] is None else float(m[4]))
                 for m in _ITERATION.finditer(stdout))


def command(script: Path, args: Sequence[str], *, ranks: int, executable: str | None = None) -> list[str]:
    """torchrun (standalone: a free rendezvous port on this host) of ``cpu_launch SCRIPT ARGS``."""
    return [executable or sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "piper_megatron.cpu_launch", str(script), *args]


def run_script(script: Path, args: Sequence[str], *, ranks: int = 2, timeout_s: float = 300.0,
               cwd: Path | None = None, env: Mapping[str, str] | None = None, realtime_priority: int | None = None,
               executable: str | None = None, announce: TextIO | None = None) -> Run:
    """Train with ``script`` on ``ranks`` local CPU ranks; raises :class:`RunFailed` (with the
    output's tail) when it fails or runs past ``timeout_s`` (then the whole process group is killed).
    ``realtime_priority``: torchrun and the ranks under SCHED_FIFO at that priority (root);
    ``executable``: the Python to run (default this one); ``announce``: where to print the command."""
    if ranks < 1:
        raise SpecError("ranks", ranks, "must be >= 1", "use 2 local CPU ranks")
    cmd = command(script, args, ranks=ranks, executable=executable)
    if announce is not None:
        print(shlex.join(cmd), file=announce, flush=True)
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    fifo = None if realtime_priority is None else \
        (lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(realtime_priority)))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=environ,
                            start_new_session=True, preexec_fn=fifo)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RunFailed(_failure(cmd, f"ran past its {timeout_s:.0f} s deadline and was killed", out, err)) from None
    if proc.returncode != 0:
        raise RunFailed(_failure(cmd, f"exited with status {proc.returncode}", out, err))
    return Run(command=tuple(cmd), stdout=out, stderr=err, args=parse_args_dump(out), iterations=parse_iterations(out))


def _failure(cmd: Sequence[str], what: str, out: str, err: str, tail: int = 6000) -> str:
    return (f"{' '.join(cmd)}\n{what}\n--- stderr (tail) ---\n{err[-tail:]}\n--- stdout (tail) ---\n"
            f"{out[-tail // 3:]}")


__all__ = ["Iteration", "Run", "RunFailed", "default_checkout", "find_script", "parse_args_dump",
           "parse_iterations", "run_script"]
