"""``piper plan --report FILE.html``: the page holds the figures ``--json`` gives and the files the
exports write, loads nothing from elsewhere, escapes its text; bad paths are user errors. The page
opened in a real browser: tests/browser."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from piper_core.cli.main import main
from piper_core.plots import timeline
from piper_core.presets import load_cluster, load_model
from piper_core.report import PlanReport, render_html
from piper_core.resource.predict import predict
from piper_core.scheduler.search import search
from piper_core.specs.parallel import ParallelPlan
from piper_core.svg import nice_ticks
from tests.report_dom import check_ranked, read_page

TINY = ["plan", "tiny-moe", "--cluster", "dgx-h100", "--gpus", "8", "--top", "3"]


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """One run: --json, --report and both exports of the same search."""
    folder = tmp_path_factory.mktemp("report")
    files = {k: folder / name for k, name in (("report", "plan.html"), ("megatron", "m.sh"), ("deepspeed", "d.json"))}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(TINY + ["--json", "--report", str(files["report"]), "--export-megatron", str(files["megatron"]),
                            "--export-deepspeed", str(files["deepspeed"])])
    return code, json.loads(out.getvalue()), files


def test_report_holds_what_json_and_exports_give(tiny_report):
    code, out, files = tiny_report
    assert code == 0
    page = read_page(files["report"].read_text())
    check_ranked(page, out)
    best = out["plans"][0]
    memory = page.tables["memory"].values()
    assert [r["stage"] for r in memory] == [s["stage"] for s in best["memory_gib"]["stages"]]
    assert [r["total"] for r in memory] == [s["total"] for s in best["memory_gib"]["stages"]]
    parts = {r["part"]: r["seconds"] for r in page.tables["timeline"].values()}
    assert parts["step"] == best["time_s"]["step"]
    assert sorted(v for k, v in parts.items() if k != "step") == sorted(best["time_s"]["breakdown"].values())
    assert page.tables["stage-times"].values() == best["time_s"]["stages"]
    assert {r["reason"]: r["plans"] for r in page.tables["rejected"].values()} == out["rejected"]
    assert page.text["export-megatron"] == files["megatron"].read_text()
    assert json.loads(page.text["export-deepspeed"]) == json.loads(files["deepspeed"].read_text())
    assert page.text["command"].startswith("piper plan tiny-moe --cluster dgx-h100 --gpus 8 --top 3 --json --report ")


def test_report_loads_nothing_from_elsewhere(tiny_report):
    text = tiny_report[2]["report"].read_text()
    page = read_page(text)
    assert page.urls == [] and "link" not in page.tags and "iframe" not in page.tags
    assert not re.search(r"@import|url\(|https?://(?!www\.w3\.org/2000/svg\")", text)
    assert page.tags.count("svg") == 3  # memory, timeline, Pareto
    assert page.tags.count("script") == 1


def test_report_says_what_the_terminal_says(tmp_path, capsys):
    """Without --json: "wrote FILE" on standard output, and the page's verdict is the lines under
    the printed table (best plan, prediction, bottleneck, why)."""
    path = tmp_path / "r.html"
    assert main(TINY + ["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"wrote {path}")
    printed = out[out.index("\nbest: ") + 1:].split("\n\n")[0].splitlines()
    assert len(printed) == 4 and printed[-1].startswith("  why: ")
    assert read_page(path.read_text()).text["verdict"] == "".join(line.strip() for line in printed)


def test_text_is_escaped():
    model, cluster = load_model("tiny-moe"), load_cluster("cpu-local")
    result = search(model, cluster, 4, 16, workers=1)
    best = [predict(model, cluster, s.plan) for s in result.best(2)]
    html = render_html(PlanReport(command="piper plan '<script>alert(1)</script>' --x \"a&b\"", model=model,
                                  cluster=cluster, gpus=4, gbs=16, result=result, best=best,
                                  verdict=["best: x", "  why: <b>fast</b>"]))
    assert "<script>alert" not in html and "<b>fast" not in html
    page = read_page(html)
    assert page.text["command"] == "piper plan '<script>alert(1)</script>' --x \"a&b\""
    assert page.text["verdict"] == "best: xwhy: <b>fast</b>"
    assert page.tags.count("script") == 1 and "export-megatron" not in page.text  # no exports given


def test_no_fit_report_names_the_lower_bound(tmp_path):
    path = tmp_path / "none.html"
    assert main(["plan", "switch-1t", "--cluster", "frontier", "--gpus", "64", "--report", str(path)]) == 1
    page = read_page(path.read_text())
    assert "needs at least" in page.text["no-fit"] and "ranked" not in page.tables
    assert sum(r["plans"] for r in page.tables["rejected"].values()) > 0


@pytest.mark.parametrize("where, message", [
    ("missing/plan.html", r"--report='.*missing/plan.html': the folder .*missing does not exist; create it first"),
    (".", r"--report='.*': is a folder; give a file name, e\.g\. --report .*plan\.html"),
])
def test_bad_report_path_is_a_user_error(tmp_path, capsys, where, message):
    path = tmp_path / where
    assert main(TINY + ["--report", str(path)]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "missing").exists()


def test_timeline_spans_fill_each_pass_and_the_tail():
    """The spans the PNG and the page draw: each pass split into parts that add up to the pass, the
    tail after the last pass of the pipeline."""
    p = predict(load_model("mixtral-8x7b"), load_cluster("dgx-h100"), ParallelPlan(
        gpus=64, tp=2, sequence_parallel=True, pp=4, vpp=2, cp=2, ep=8, etp=1, global_batch_size=512,
        recompute="full", recompute_num_layers=1, a2a="hierarchical", a2a_chunks=4))
    tl = timeline(p)
    assert len(tl.spans) == 4 and tl.drawn == 16 < tl.microbatches and "vpp=2" in tl.notes[1]
    last = max(op.end for ops in tl.passes for op in ops)
    for by_part, ops in zip(tl.spans, tl.passes):
        inside = sum(w for part, ranges in by_part.items() if part not in tl.tail for _, w in ranges)
        assert inside == pytest.approx(sum(op.end - op.start for op in ops), rel=1e-9)
        assert by_part["data-parallel sync"][0][0] == pytest.approx(last)
    assert tl.end == pytest.approx(last + sum(tl.tail.values()))


def test_nice_ticks():
    assert nice_ticks(80) == [0, 20, 40, 60, 80]
    assert nice_ticks(0.0071, 6) == pytest.approx([0, 0.002, 0.004, 0.006])
    assert nice_ticks(0) == [0.0]
