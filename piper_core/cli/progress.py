"""A small progress bar with ETA on stderr, shown only on a terminal (logs stay clean)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, *, stream: TextIO | None = None, width: int = 30):
        self.label, self.stream, self.width = label, stream or sys.stderr, width
        self.start = time.perf_counter()
        self.enabled = self.stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total == 0:
            return
        frac = done / total
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * int(frac * self.width)
        self.stream.write(f"\r{self.label} [{bar:<{self.width}}] {100 * frac:5.1f}% ETA {eta:4.1f} s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
