"""Published GPU results (piper_core/validate/published.yaml): every row quotes its number, enough rows
from enough sources are predicted, a bad row is refused by name, and the table's MAPE is the mean of
the rows' errors."""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

import pytest
import yaml

from piper_core.errors import SpecError
from piper_core.validate import published as pub

RAW = yaml.safe_load(pub.DEFAULT_FILE.read_text())

GOOD = {
    "id": "demo",
    "source": {"url": "https://example.org/moe", "title": "a measured Mixtral run",
               "excerpt": "Mixtral 8X7B bf16 training to achieve **438 TFLOPS**"},
    "model": "mixtral-8x7b", "cluster": "dgx-h100", "gpus": 64, "precision": "bf16",
    "plan": {"ep": 8, "pp": 4, "vpp": 8, "micro_batch_size": 1, "global_batch_size": 256},
    "measured": {"metric": "tflops_per_gpu", "as_written": "438"},
    "assumptions": ["recompute none"],
}


@pytest.fixture(scope="module")
def results() -> tuple[pub.Result, ...]:
    return pub.evaluate(pub.load_rows())


def _write(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "rows.yaml"
    path.write_text(yaml.safe_dump(rows, sort_keys=False))
    return path


def test_every_row_quotes_its_measured_number_as_written():
    assert RAW, "published.yaml has no rows"
    for row in RAW:
        source = row["source"]
        assert source["excerpt"].strip(), row["id"]
        assert row["measured"]["as_written"] in source["excerpt"], row["id"]
        assert source["title"].strip() and source["url"].startswith("https://"), row["id"]
        if "commit" in source:  # a repository file is cited at the commit it was read at
            assert source["url"].endswith(f"{source['commit']}/{source['path']}"), row["id"]


def test_at_least_twelve_predicted_rows_from_four_sources(results):
    predicted = [r for r in results if r.prediction is not None]
    assert len(predicted) >= 12
    assert len({r.row.source.origin for r in predicted}) >= 4
    assert all(r.row.precision in ("bf16", "fp16", "fp8") for r in predicted)
    # an fp8 row is predicted as a bf16 plan with FP8 GEMMs in the format it names
    assert all(r.row.plan.precision == ("bf16" if r.row.precision == "fp8" else r.row.precision)
               and (r.row.plan.fp8 is not None) == (r.row.precision == "fp8") for r in predicted)
    assert any(r.row.precision == "fp8" for r in predicted)


def test_prediction_is_converted_to_the_published_metric(results):
    for r in results:
        if r.prediction is None:
            continue
        p, tokens = r.prediction, r.row.plan.global_batch_size * r.row.model.seq_length
        assert pub.metric_value(p, "tokens_per_s") == pytest.approx(tokens / p.time.step)
        assert pub.metric_value(p, "tokens_per_s_per_gpu") == pytest.approx(tokens / p.time.step / r.row.gpus)
        assert pub.metric_value(p, "tflops_per_gpu") == pytest.approx(p.flops.model / p.time.step / r.row.gpus / 1e12)
        assert r.error == pytest.approx(r.predicted / r.row.measured.value - 1)


def test_loader_accepts_a_minimal_row(tmp_path):
    (row,) = pub.load_rows(_write(tmp_path, [GOOD]))
    assert row.plan.dp == 16 and row.measured.value == 438.0


@pytest.mark.parametrize(("change", "match"), [
    (lambda r: r["plan"].update(tpp=2),
     r"row 1 'demo': plan\.tpp=2: is not a key of ParallelPlan; did you mean 'plan\.tp'"),
    (lambda r: r.update(preciison="bf16"), r"'demo': preciison='bf16'.*did you mean 'precision'"),
    (lambda r: r["measured"].update(as_written="439"), r"'demo': measured\.as_written='439': does not appear"),
    (lambda r: r["measured"].update(as_written="fast"), r"'demo': measured\.as_written='fast': is not a number"),
    (lambda r: r["source"].update(excerpt="   "), r"'demo': source\.excerpt="),
    (lambda r: r.update(precision="fp8"), r"'demo': plan\.fp8=None: an fp8 row's plan names the FP8 format"),
    (lambda r: r["plan"].update(fp8="hybrid"), r"'demo': plan\.fp8='hybrid': is set on a bf16 row"),
    (lambda r: r["plan"].update(ep=3), r"'demo': plan\.ep=3"),
    (lambda r: r.update(model_overrides={"num_layer": 2}), r"'demo': model_overrides\.num_layer=2.*num_layers"),
    (lambda r: r.pop("plan"), r"'demo': plan=None: a row has a plan or a not_predicted reason"),
    (lambda r: r.update(cluster="dgx-h10"), r"'demo': cluster='dgx-h10'.*dgx-h100"),
])
def test_loader_rejects_a_bad_row_naming_row_and_key(tmp_path, change, match):
    row = copy.deepcopy(GOOD)
    change(row)
    with pytest.raises(SpecError, match=match):
        pub.load_rows(_write(tmp_path, [row]))


def test_loader_rejects_a_repeated_id(tmp_path):
    with pytest.raises(SpecError, match=r"row 2: id='demo': is used by an earlier row"):
        pub.load_rows(_write(tmp_path, [GOOD, GOOD]))


def test_table_mape_is_the_mean_of_the_rows_absolute_errors(results):
    s = pub.summary(results)
    timed = [r for r in results if r.prediction is not None]
    assert s["mape"] == pytest.approx(statistics.fmean(abs(r.error) for r in timed))
    assert s["mape_fitting"] == pytest.approx(statistics.fmean(abs(r.error) for r in timed if r.prediction.feasible))
    assert s["predicted_rows"] == len(timed) and set(s["over_memory"]) <= {r.row.id for r in timed}
    table = pub.markdown(results)
    assert f"**MAPE {100 * s['mape']:.1f}%** over the {len(timed)} predicted rows" in table
    lines = {line.split(" | ")[0].lstrip("| ").rstrip(" ?"): line
             for line in table.splitlines() if line.startswith("| ")}
    for r in timed:
        assert f"| {100 * r.error:+.1f}% |" in lines[r.row.id]
    for r in results:
        if r.prediction is None:
            assert "not predicted" in lines[r.row.id]


def test_json_output_parses_and_carries_the_same_mape(capsys):
    assert pub.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in data["rows"]] == [r["id"] for r in RAW]
    timed = [r for r in data["rows"] if r["predicted"] is not None]
    assert data["summary"]["mape"] == pytest.approx(statistics.fmean(abs(r["predicted"] / r["measured"] - 1)
                                                                     for r in timed))


def test_cli_names_the_bad_row_and_exits_2(tmp_path, capsys):
    row = copy.deepcopy(GOOD)
    row["plan"]["mbs"] = 1
    assert pub.main(["--file", str(_write(tmp_path, [row]))]) == 2
    err = capsys.readouterr().err
    assert "'demo'" in err and "plan.mbs" in err and "micro_batch_size" in err


def test_docs_quote_the_table_as_the_command_prints_it_today():
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("docs_refresh", root / "docs" / "refresh.py")
    refresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refresh)
    assert "docs/published.md" in refresh.FILES
    text = (root / "docs" / "published.md").read_text()
    assert "<!-- run-md: python -m piper_core.validate.published -->" in text
    stale = refresh.stale(text)
    assert not stale, "docs/published.md is stale: run `python docs/refresh.py`"
