"""The plan report opened in a real browser: Debian's headless Chromium loads ``piper plan --report``'s
page from disk, runs its script, and dumps the DOM; the ranked table read back from that DOM equals
the plans ``--json`` gave in the same run, and the summary the page's script wrote names them.

``make test-browser`` installs Chromium first (``make browser``) and sets PIPER_REQUIRE_BROWSER=1:
then a missing browser fails the test. Run directly with pytest, a missing browser skips it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest

from piper_core.cli.main import main
from tests.report_dom import check_ranked, read_page

CHROMIUM = Path(os.environ.get("PIPER_CHROMIUM", "/usr/bin/chromium"))
TIMEOUT_S = 60
# headless as root on a machine with no network: no sandbox, no GPU, and none of the background
# connections (component updates, sync, QUIC) whose refusals would slow or stall the load
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")
PLAN = ["plan", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "16", "--gbs", "128", "--top", "5"]


@pytest.fixture(scope="module")
def chromium() -> Path:
    if CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    why = f"no Chromium at {CHROMIUM}: `make browser` installs it (apt-get install chromium)"
    if os.environ.get("PIPER_REQUIRE_BROWSER") == "1" or os.environ.get("CI") == "true":
        pytest.fail(f"the browser test must run here: {why}")
    pytest.skip(why)


def dump_dom(chromium: Path, page: Path, profile: Path) -> str:
    """The DOM after ``page`` loaded and its scripts ran, as Chromium serialises it."""
    command = [str(chromium), *FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.resolve().as_uri()]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"Chromium did not finish within {TIMEOUT_S} s: {' '.join(command)}")
    if done.returncode != 0 or "<table" not in done.stdout:
        pytest.fail(f"{' '.join(command)} exited {done.returncode} and printed {len(done.stdout)} characters with no "
                    f"<table>; stderr ends: {done.stderr[-2000:]}")
    return done.stdout


def test_chromium_reads_back_the_ranked_plans(chromium, tmp_path):
    report = tmp_path / "plan.html"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(PLAN + ["--json", "--report", str(report)]) == 0
    plans = json.loads(out.getvalue())
    profile = tmp_path / "profile"
    profile.mkdir()
    page = read_page(dump_dom(chromium, report, profile))

    check_ranked(page, plans)
    ranked = page.tables["ranked"]
    assert ranked.header_text[:3] == ["#", "plan", "tp"]
    best = ranked.texts()[0]
    assert page.text["summary"] == (f"{len(plans['plans'])} of {plans['feasible']:,} feasible plans shown; best: "
                                    f"{best['plan']}, step {best['step_s']} s, MFU {best['mfu']}")
    stages = plans["plans"][0]["memory_gib"]["stages"]
    assert [r["stage"] for r in page.tables["memory"].values()] == [s["stage"] for s in stages]
    assert page.tags.count("svg") == 3
