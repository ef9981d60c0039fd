"""The cases ``piper validate`` runs, from the pre-registered suites (:mod:`.suite`,
``suites/full.yaml`` and ``suites/quick.yaml``): small MoE models on 2 to 4 CPU ranks, local or on the
emulated 2-node cluster, varying ep, dp, pp, micro-batch size, experts and top-k; through Megatron-Core
with Piper's dispatcher, and a few through DeepSpeed-MoE with Piper's MoE layer.

Cases of one ``group`` share model, world size, global batch and cluster: they are alternative plans
for the same job, among which the scheduler's pick (least predicted step time) is compared with the
measured fastest. Why the models are what they are is written in the suite file.
"""

from __future__ import annotations

from piper_core.errors import SpecError
from piper_core.validate.suite import Case, Suite, load_suite

__all__ = ["CASES", "QUICK", "VAL_MODEL", "Case", "select", "suite_for"]

_FULL = load_suite("full")
VAL_MODEL = _FULL.models["val-moe"]
CASES: tuple[Case, ...] = _FULL.cases
QUICK: tuple[str, ...] = tuple(c.name for c in load_suite("quick").cases)
"""The quick suite's cases (``piper validate --quick``, in the default test run)."""


def suite_for(ref: str | None, *, quick: bool = False) -> Suite:
    """The suite ``ref`` (a name or path), or the quick / full built-in one."""
    return load_suite(ref or ("quick" if quick else "full"))


def select(names: list[str] | None, *, quick: bool = False, suite: Suite | None = None) -> tuple[Case, ...]:
    """The cases of ``suite`` (default: the quick or full built-in one) named in ``names`` (all when None)."""
    suite = suite or suite_for(None, quick=quick)
    if not names:
        return suite.cases
    known = {c.name: c for c in suite.cases}
    for n in names:
        if n not in known:
            raise SpecError("--cases", n, f"is not a case of the suite {suite.name!r}", f"choose from {', '.join(known)}")
    return tuple(known[n] for n in names)
