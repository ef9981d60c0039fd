"""Read a plan report (``piper plan --report``) back as structures: the HTML file as written, or the
DOM headless Chromium dumps after loading it. Standard library only (``html.parser``).

``read_page(text)`` gives each ``<table id=...>``'s header keys and rows (per cell: ``data-key`` ->
(JSON-decoded ``data-value``, text)), the text of each element with an ``id``, and every URL-bearing
attribute, so a test can compare the page with ``piper plan --json`` (:func:`check_ranked`) and
check it loads nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any

URL_ATTRS = ("src", "href", "srcset", "action", "data", "poster", "xlink:href")


@dataclass
class Table:
    headers: list[str] = field(default_factory=list)  # data-key of each <th>, in order
    header_text: list[str] = field(default_factory=list)
    rows: list[dict[str, tuple[Any, str]]] = field(default_factory=list)  # data-key -> (value, text)

    def values(self) -> list[dict[str, Any]]:
        return [{k: v for k, (v, _) in row.items()} for row in self.rows]

    def texts(self) -> list[dict[str, str]]:
        return [{k: t for k, (_, t) in row.items()} for row in self.rows]


@dataclass
class Page:
    tables: dict[str, Table] = field(default_factory=dict)
    text: dict[str, str] = field(default_factory=dict)  # id -> text content
    tags: list[str] = field(default_factory=list)  # every start tag, in order
    urls: list[str] = field(default_factory=list)  # values of URL-bearing attributes


class _Reader(HTMLParser):
    VOID = {"meta", "br", "img", "input", "link", "hr", "area", "base", "col", "embed", "source", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self.open_ids: list[tuple[str, str, int]] = []  # (id, tag, depth)
        self.depth = 0
        self.table: Table | None = None
        self.cell: tuple[str, Any, str] | None = None  # (kind, key, value)
        self.cell_text: list[str] = []
        self.row: dict[str, tuple[Any, str]] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.page.tags.append(tag)
        self.page.urls += [a[k] or "" for k in URL_ATTRS if k in a]
        if tag in self.VOID:
            return
        self.depth += 1
        if "id" in a:
            self.open_ids.append((a["id"] or "", tag, self.depth))
            self.page.text[a["id"] or ""] = ""
            if tag == "table":
                self.table = self.page.tables.setdefault(a["id"] or "", Table())
        if self.table is None:
            return
        if tag == "tr":
            self.row = {}
        elif tag in ("th", "td"):
            value = json.loads(a["data-value"]) if "data-value" in a else None
            self.cell, self.cell_text = (tag, a.get("data-key") or "", value), []

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID:
            return
        if self.cell is not None and tag == self.cell[0]:
            kind, key, value = self.cell
            text = "".join(self.cell_text).strip()
            if kind == "th":
                self.table.headers.append(key)
                self.table.header_text.append(text)
            elif self.row is not None:
                self.row[key] = (value, text)
            self.cell = None
        elif tag == "tr" and self.table is not None and self.row:
            self.table.rows.append(self.row)
            self.row = None
        elif tag == "table":
            self.table = None
        while self.open_ids and self.open_ids[-1][2] >= self.depth:
            self.open_ids.pop()
        self.depth -= 1

    def handle_data(self, data: str) -> None:
        for ident, _, _ in self.open_ids:
            self.page.text[ident] += data
        if self.cell is not None:
            self.cell_text.append(data)


def read_page(text: str) -> Page:
    reader = _Reader()
    reader.feed(text)
    reader.close()
    return reader.page


def ranked_expected(plan: dict, rank: int) -> dict:
    """What the ranked table's row of one ``--json`` plan must hold, by data-key."""
    p, t = plan["plan"], plan["time_s"]
    keys = ("tp", "pp", "vpp", "cp", "dp", "ep", "etp", "edp", "micro_batch_size", "num_microbatches", "recompute",
            "distributed_optimizer", "a2a", "a2a_chunks")
    return {"rank": rank, **{k: p[k] for k in keys}, "step_s": t["step"], "mfu": plan["mfu"],
            "tflops_per_gpu": plan["tflops_per_gpu"], "tokens_per_s": plan["tokens_per_s"],
            "peak_gib": plan["memory_gib"]["peak"], "exposed_a2a_share": t["breakdown"]["exposed_a2a"] / t["step"],
            "bubble_share": t["breakdown"]["bubble"] / t["step"]}


def check_ranked(page: Page, out: dict) -> None:
    """The page's ranked table equals ``--json``'s plans (``out``), row for row."""
    ranked = page.tables["ranked"]
    assert len(ranked.rows) == len(out["plans"]) >= 1
    for rank, (row, plan) in enumerate(zip(ranked.values(), out["plans"]), 1):
        assert set(row) == set(ranked.headers)
        assert {k: row[k] for k in ranked_expected(plan, rank)} == ranked_expected(plan, rank)
        assert re.fullmatch(rf"tp{plan['plan']['tp']} pp{plan['plan']['pp']} .* ep{plan['plan']['ep']} .*", row["plan"])
