"""Every figure the docs quote from a committed benchmark result is in that result.

The convention: a block of a page that quotes a result starts with a marker naming its
JSON file(s),

    <!-- figures: bench/results/bandwidth.json -->
    | method | bytes/token | ... |
    |---|---:|...|
    | dp | 2845.26 | ... |

and runs to the next blank line (a table, or one paragraph). The word ``percent`` after the
file names says the block's bare numbers are percentages or points of the JSON's fractions
(the column headers can say so too, with % or "points"). Every number in the block,
outside `code` spans and a table's header row, must be a value of the JSON, rounded as the
page rounds it (2845.26 matches 2845.2629; 1.3% matches 0.013 or 1.3, and so does 1.3 in a
column headed with % or "points"). Derived figures (a
ratio of two results, a sum) stay outside marked blocks. A result rerun with other
numbers fails here until the page is updated.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKER = re.compile(r"<!--\s*figures:\s*(.+?)\s*-->")
# a number standing alone: not part of a word (int4, dc0, v2) nor of a version (3.11.7)
NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w.])|(?<![\w.,])-?\d+(?:\.\d+)?(?![\w.,]\d)(?!\w)")


def blocks() -> list[tuple[str, list[str], list[str]]]:
    """(where, JSON paths, lines) for every marked block of every page."""
    found = []
    for page in DOCS:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = MARKER.search(line)
            if not m:
                continue
            body = []
            for follow in lines[i + 1:]:
                if not follow.strip():
                    if body:
                        break
                    continue
                body.append(follow)
            found.append((f"{page.name}:{i + 1}", m.group(1).split(), body))  # paths, and flags
    return found


def quoted(lines: list[str]) -> list[tuple[str, str]]:
    """(number as written, its unit) for every figure in a block. The unit is "%" for a
    number written with % or in a table column whose header says % or points (0.013 is 1.3
    there), "kB", "MB" or "GB" for a size written so (the JSON counts bytes), else ""."""
    out = []
    header: list[str] | None = None
    for line in lines:
        cells = [line]
        percent_cells = [False]
        if line.lstrip().startswith("|"):
            cells = line.strip().strip("|").split("|")
            if header is None:
                header = cells  # names columns: no figures
                continue
            if re.fullmatch(r"[|\s:-]+", line):
                continue  # the separator row
            percent_cells = [("%" in h or "points" in h) for h in header] + [False] * len(cells)
        for cell, percent_column in zip(cells, percent_cells):
            text = re.sub(r"`[^`]*`", " ", cell)
            for m in NUMBER.finditer(text):
                unit = re.match(r"\s?(%|kB|MB|GB)(?!\w)", text[m.end():])
                out.append((m.group(0), unit.group(1) if unit else ("%" if percent_column else "")))
    return out


def values(doc) -> list[float]:
    if isinstance(doc, bool):
        return []
    if isinstance(doc, (int, float)):
        return [float(doc)] if math.isfinite(doc) else []
    if isinstance(doc, dict):
        return [v for x in doc.values() for v in values(x)]
    if isinstance(doc, list):
        return [v for x in doc for v in values(x)]
    return []


SCALES = {"": (1.0,), "%": (1.0, 100.0), "kB": (1e-3,), "MB": (1e-6,), "GB": (1e-9,)}


def matches(written: str, unit: str, pool: list[float]) -> bool:
    number = float(written.replace(",", ""))
    decimals = len(written.split(".", 1)[1]) if "." in written else 0
    half = 0.5 * 10 ** -decimals + 1e-9
    return any(abs(v * s - number) <= half for v in pool for s in SCALES[unit])


BLOCKS = blocks()


def test_the_docs_mark_the_figures_they_quote():
    assert len(BLOCKS) >= 3, "docs quote committed results in marked blocks"


@pytest.mark.parametrize(("where", "paths", "lines"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_every_marked_figure_is_in_its_result(where, paths, lines):
    pool = []
    percent = "percent" in paths  # the block's bare numbers are percentages or points
    paths = [p for p in paths if p != "percent"]
    for path in paths:
        result = ROOT / path
        assert result.is_file() and path.startswith("bench/results/") and path.endswith(".json"), (
            f"{where}: the marker names {path}, not a committed bench/results/*.json"
        )
        pool += values(json.loads(result.read_text()))
    figures = [(w, unit or ("%" if percent else "")) for w, unit in quoted(lines)]
    assert figures, f"{where}: a marked block with no figure in it"
    missing = [w + unit for w, unit in figures if not matches(w, unit, pool)]
    assert not missing, f"{where}: figures not in {', '.join(paths)}: {missing}"


def test_the_figure_parser_reads_what_a_page_writes():
    lines = [
        "| method | bytes/token | 4 learners | goodput % |",
        "|---|---:|---:|---:|",
        "| ddiloco-int4 | 2,845.26 | 1.3% | 71.2 (71.0–71.3) |",
        "ran `--dp-steps 40` on Python 3.11.7 (dc0, v2): 12 s",
    ]
    lines[3] += ", 471.4 MB"
    assert quoted(lines) == [
        ("2,845.26", ""), ("1.3", "%"), ("71.2", "%"), ("71.0", "%"), ("71.3", "%"), ("12", ""), ("471.4", "MB"),
    ]
    assert matches("2,845.26", "", [2845.2629]) and not matches("2845.27", "", [2845.2629])
    assert matches("1.3", "%", [0.013]) and not matches("1.3", "", [0.013])
    assert matches("471.4", "MB", [471_377_880]) and not matches("471.4", "", [471_377_880])
