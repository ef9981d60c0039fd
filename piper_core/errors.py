"""The two kinds of failure Piper reports (see STYLE.md, "Errors").

* :class:`SpecError` -- bad user input. The message names the key, the value, the rule that was
  broken and the fix, so a user can correct the file or flag without reading source.
* :class:`Infeasible` -- a well-formed plan that cannot run (does not fit memory, breaks a
  divisibility rule of the host framework). The scheduler counts and reports these; they are
  domain outcomes, not crashes.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class SpecError(ValueError):
    """Bad user input: ``key`` had ``value``, which breaks ``rule``; ``fix`` says what to do."""

    def __init__(self, key: str, value: object, rule: str, fix: str, *, where: str | None = None):
        self.key, self.value, self.rule, self.fix, self.where = key, value, rule, fix, where
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{key}={value!r}: {rule}; {fix}")

    def __reduce__(self):  # pickled whole (a forked search worker sends its errors back)
        return _spec_error, (self.key, self.value, self.rule, self.fix, self.where)


class Infeasible(ValueError):
    """A plan that is well formed but cannot run; ``reason`` is one sentence for the report."""

    def __init__(self, reason: str, *, rule: str):
        self.reason, self.rule = reason, rule
        super().__init__(reason)

    def __reduce__(self):
        return _infeasible, (self.reason, self.rule)


def _spec_error(key: str, value: object, rule: str, fix: str, where: str | None) -> SpecError:
    return SpecError(key, value, rule, fix, where=where)


def _infeasible(reason: str, rule: str) -> Infeasible:
    return Infeasible(reason, rule=rule)


def nearest(word: str, choices: Iterable[str]) -> str | None:
    """The closest valid spelling of ``word`` among ``choices`` (None when nothing is close)."""
    by_lower = {c.lower(): c for c in choices}
    found = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.5)
    return by_lower[found[0]] if found else None


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n``, ascending; used to suggest valid parallel sizes."""
    return [d for d in range(1, n + 1) if n % d == 0]
