"""Megatron-LM's own alltoall dispatcher tests pass with every Piper dispatcher variant.

``TestAlltoAllDispatcher`` of ``tests/unit_tests/transformer/moe/test_a2a_token_dispatcher.py``
(Megatron-LM core_v0.16.1) runs from a checkout, its bodies unchanged, on 2 gloo CPU processes
(tests/megatron/megatron_lm_ranks.py, one spawn for everything): against Megatron's
``MoEAlltoAllTokenDispatcher`` ("stock") and Piper's flat, hierarchical, pipelined (2 chunks) and
tuned (``tune``) dispatchers. Only the backend (gloo, CPU) and the dispatcher class are swapped. Its
tests call the dispatcher's phases themselves (``dispatch_preprocess``, ``token_dispatch``,
``dispatch_postprocess``, ..., not through ``MoELayer``'s forward): the pipelined variants run those
steps unpipelined, say so once per dispatcher, and leave the chunk tuner alone; a layer driven that
way still runs pipelined through its own forward afterwards.

Which of Megatron's parametrizations run on 2 ranks:

* ``tp_size, ep_size``: (1, 1) as Megatron lists it (data parallel 2), and (1, 2), expert parallel
  over both ranks, in place of (1, 8), (8, 1) and (4, 2), which need 8 ranks (eight processes that
  import Megatron do not fit this tier's time on 2 cores); (8, 1) and (4, 2) also split each expert
  over 8 or 4 ranks (``MoEModelTestContainer`` sets expert tensor parallel = tp), which Piper's
  dispatcher refuses (it keeps experts whole: expert tensor parallel size 1).
* ``permute_fusion``: False only; True is Transformer Engine's fused permutation (TE >= 2.1).
* ``deterministic``: both. Test bodies: ``test_forward_backward`` (dropless), ``test_capacity_forward_backward``
  (capacity factor 0.5, token dropping), ``test_capacity_padding_forward_backward`` (drop and pad).
  Not run: ``test_router_padding_for_fp8_forward_backward`` (FP8, TE >= 1.7: a GPU feature) and
  ``test_placeholder`` (empty).

The checkout is ``$PIPER_MEGATRON_LM``, else ``../shared/third_party/megatron-lm-core_v0.16.1``
beside the repository. Without it (or without ``six`` and ``regex``, which ``megatron.training``
imports) the tests skip, except under CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.megatron.megatron_lm_ranks import A2A_TESTS, CASES, PIPELINED, VARIANTS

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
pytestmark = pytest.mark.megatron

ENV = "PIPER_MEGATRON_LM"
DEFAULT = Path(__file__).resolve().parents[2].parent / "shared" / "third_party" / "megatron-lm-core_v0.16.1"
NEEDS = ("six", "regex")  # imported by megatron.training, which test_token_dispatcher.py imports


def megatron_lm_checkout(environ: Mapping[str, str]) -> Path:
    """The Megatron-LM checkout the tests run from; skips without one, fails under CI."""
    root = Path(environ.get(ENV) or DEFAULT)
    tests_file = root / Path(*A2A_TESTS.split(".")).with_suffix(".py")
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if not tests_file.is_file():
        reason = (f"Megatron-LM checkout not found: {tests_file} does not exist; set {ENV} to a Megatron-LM "
                  f"checkout (tag core_v0.16.1) or put one at {DEFAULT}")
    elif missing:
        reason = f"megatron.training needs {', '.join(missing)}: pip install {' '.join(missing)}"
    else:
        return root
    if environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: Megatron-LM's own dispatcher tests must run)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def megatron_lm() -> list[dict]:
    """Per rank: every variant x case of Megatron-LM's tests, and the fused-after-phases check."""
    from tests.gloo import run_ranks
    from tests.megatron.megatron_lm_ranks import run_rank

    return run_ranks(2, run_rank, str(megatron_lm_checkout(os.environ)), timeout_s=240)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_megatron_lm_a2a_dispatcher(megatron_lm, variant, case):
    for rank, results in enumerate(megatron_lm):
        got = results["cases"][variant][case]
        assert got["error"] is None, f"rank {rank}: Megatron-LM's {case} failed with the {variant} dispatcher:\n" \
                                     f"{got['error']}"
        if variant == "stock":
            assert got["built"] == [], f"rank {rank}: Piper's dispatcher was built for the stock run"
            continue
        assert got["built"] and set(got["built"]) == {"PiperTokenDispatcher"}, f"rank {rank}: built {got['built']}"
        assert got["used"] >= 1, f"rank {rank}: no Piper dispatcher ran"
        expected = got["used"] if variant in PIPELINED else 0  # once per dispatcher driven phase by phase
        assert (got["warned"], len(got["warnings"])) == (expected, expected), f"rank {rank}: {got['warnings']}"
        assert all(calls == 0 for calls in got["tuner_calls"]), f"rank {rank}: phase-driven steps spent " \
                                                                f"tuner calls {got['tuner_calls']}"
        assert bool(got["tuner_calls"]) == (variant == "tune"), f"rank {rank}: tuners {got['tuner_calls']}"


@pytest.mark.parametrize("variant", PIPELINED)
def test_pipelined_layer_still_fused_after_phase_driven_steps(megatron_lm, variant):
    for rank, results in enumerate(megatron_lm):
        got = results["fused"][variant]
        assert got["error"] is None, f"rank {rank}: {got['error']}"
        assert got["dispatcher"] == "PiperTokenDispatcher", f"rank {rank}"
        assert len(got["warnings"]) == 1, f"rank {rank}: two phase-driven steps warned {got['warnings']}"
        assert "layer 0" in got["warnings"][0] and "one chunk of flat exchanges" in got["warnings"][0]
        # pipelined: 2 chunks; tune: the tuner's first candidate (1 chunk), its only call so far
        assert (got["expert_calls"], got["tuner_calls"]) == ((2, None) if variant == "pipelined" else (1, 1)), \
            f"rank {rank}: {got}"


def test_missing_checkout_skips_here_and_fails_in_ci(tmp_path):
    absent = {ENV: str(tmp_path / "no-checkout")}
    with pytest.raises(pytest.skip.Exception, match="Megatron-LM checkout not found"):
        megatron_lm_checkout(absent)
    with pytest.raises(pytest.fail.Exception, match=f"checkout not found.*{ENV}.*CI=true"):
        megatron_lm_checkout({**absent, "CI": "true"})
