"""The 1T Switch recipe's model, built by Megatron-Core, has the parameter count Piper states, and
the recipe README states that count.

``recipes/switch-1t`` trains the ``switch-1t`` preset. Megatron-Core builds it on the meta device
(shapes, no storage) through :mod:`piper_megatron.build`, as ``test_param_counts.py`` does, on one
gloo process (tp = pp = ep = 1, so one rank holds every parameter). Building all 24 layers of 512
experts each would construct 12,288 expert modules; instead the model is built at depths 1 and 2,
and the full depth is reached by scaling: every layer of switch-1t is the same MoE layer
(``moe_layer_freq`` 1, no leading dense layers), so

    count(L) = count(1) + (L - 1) * (count(2) - count(1))

holds exactly for the dense and the expert parameters separately. The test checks the identity's
premise (Piper's count at depths 1 and 2 equals Megatron's, and the layers are all MoE), then the
scaled Megatron count against :func:`piper_core.resource.params.total_params` of the full model.

The README check parses "N parameters" from ``recipes/switch-1t/README.md`` (the line that names
``total_params``), so a README left behind by a change to the model fails here.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from piper_core.presets import load_model
from piper_core.resource.params import stage_params, total_params
from piper_core.specs.model import ModelSpec
from piper_core.specs.parallel import ParallelPlan
from tests.gloo import run_ranks

pytest.importorskip("megatron.core", reason="the Megatron-Core tier needs megatron-core installed")
from tests.megatron.test_param_counts import _count  # noqa: E402  (after the skip: it imports Megatron's tier)

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "switch-1t"
MODEL = "switch-1t"
DEPTHS = (1, 2)
PLAN = ParallelPlan(gpus=1, global_batch_size=1)  # tp = pp = ep = etp = 1: one rank holds everything


def _at_depth(model: ModelSpec, layers: int) -> ModelSpec:
    return dataclasses.replace(model, num_layers=layers)


def _build_on_rank(rank: int, world: int, name: str, depths: tuple[int, ...]) -> dict[int, Any]:
    """Megatron's dense/expert counts of ``name`` built on the meta device at each depth."""
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns at import about missing TE/Apex
    from megatron.core import parallel_state

    from piper_megatron.build import gpt_model_chunks
    from piper_megatron.cpu import install_cpu_shims

    install_cpu_shims()
    parallel_state.initialize_model_parallel()
    model = load_model(name)
    try:
        return {depth: _count(gpt_model_chunks(_at_depth(model, depth), PLAN, device="meta"), expert_parallel=False)
                for depth in depths}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def megatron_counts() -> dict[int, Any]:
    return run_ranks(1, _build_on_rank, MODEL, DEPTHS, timeout_s=240)[0]


def test_reduced_depths_match_piper(megatron_counts):
    model = load_model(MODEL)
    assert all(model.moe_layer_pattern), "the scaling below assumes every layer is the same MoE layer"
    for depth in DEPTHS:
        want = stage_params(_at_depth(model, depth), PLAN)[0]
        got = megatron_counts[depth]
        assert (got["dense"], got["expert"]) == (want.dense, want.expert), (
            f"depth {depth}: Megatron dense/expert {got['dense']}/{got['expert']}, Piper {want.dense}/{want.expert}")


def test_full_depth_megatron_count_equals_piper(megatron_counts):
    model = load_model(MODEL)
    one, two = megatron_counts[1], megatron_counts[2]
    scaled = {kind: one[kind] + (model.num_layers - 1) * (two[kind] - one[kind]) for kind in ("dense", "expert")}
    want = stage_params(model, PLAN)[0]
    assert (scaled["dense"], scaled["expert"]) == (want.dense, want.expert)
    assert scaled["dense"] + scaled["expert"] == total_params(model)


def readme_parameter_count(text: str) -> int:
    """The exact count on the README line that states ``total_params``, e.g.
    ``1,032,591,015,936 parameters (`total_params`)``."""
    found = re.findall(r"([\d,]{7,}) parameters[^\n]*total_params", text)
    if len(found) != 1:
        raise AssertionError(f"expected one 'N parameters ... total_params' line in the recipe README, found {found}")
    return int(found[0].replace(",", ""))


def test_readme_states_piper_count():
    stated = readme_parameter_count((RECIPE / "README.md").read_text())
    assert stated == total_params(load_model(MODEL)), "recipes/switch-1t/README.md states a stale parameter count"
