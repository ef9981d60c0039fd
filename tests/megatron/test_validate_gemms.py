"""``python -m piper_core.validate.gemms`` end to end: a suite case trained under the profiler on its 2
ranks (real Megatron-Core), its products grouped by shape, priced and timed alone (~30 s)."""

from __future__ import annotations

import json


def test_a_case_is_profiled_priced_and_timed(tmp_path, capsys):
    from piper_core.validate import gemms

    out = tmp_path / "g.json"
    assert gemms.main(["2r-ep2-mbs2", "--profile", "cpu-local", "--steps", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    shapes = {(r["batch"], r["m"], r["k"], r["n"]) for r in result["shapes"]}
    # val-moe: hidden 128, ffn 256 experts, seq 128, micro-batch 2 (256 tokens), 4 heads of 32
    assert (1, 256, 128, 384) in shapes  # the fused QKV projection, forward
    assert any(b == 8 for b, *_ in shapes)  # core attention: micro-batch 2 x 4 heads
    for r in result["shapes"]:
        assert r["calls_per_step"] > 0 and r["measured_us"] > 0 and r["priced_us"] > 0
        assert r["hot_us"] > 0 and r["pool_us"] > 0
    total = result["ms_per_step"]
    assert total["measured_us"] > 0 and total["priced_us"] > 0
    printed = capsys.readouterr().out
    assert printed.startswith("2r-ep2-mbs2: rank 0's matrix products per training step (2 steps under the profiler)")
    assert "per step: in the step" in printed
    assert gemms.main(["--report", str(out)]) == 0  # the recorded result printed again, nothing measured
    assert capsys.readouterr().out == printed
