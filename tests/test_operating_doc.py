"""docs/operating.md lists every metrics.jsonl event kind the services write, with every
field each writes: the table is read from the doc and the kinds and fields from the code."""

from __future__ import annotations

import ast
import pathlib
import re

from support import parse_python

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ROOT / "services" / "ddiloco"


def events_in_code() -> dict[str, set[str]]:
    """kind -> keyword fields, from every ``metrics.event("kind", field=...)`` call and every
    ``("kind", {"field": ...})`` pair a service returns for logging."""
    kinds: dict[str, set[str]] = {}
    for path in SERVICES.rglob("*.py"):
        for node in ast.walk(parse_python(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "event"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                kinds.setdefault(node.args[0].value, set()).update(kw.arg for kw in node.keywords if kw.arg)
            elif (isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[0], ast.Constant)
                    and isinstance(node.elts[0].value, str) and isinstance(node.elts[1], ast.Dict)
                    and all(isinstance(k, ast.Constant) for k in node.elts[1].keys)):
                kinds.setdefault(node.elts[0].value, set()).update(k.value for k in node.elts[1].keys)
    return kinds


def events_in_doc() -> dict[str, str]:
    """kind -> the text of its row, from the events table of docs/operating.md."""
    text = (ROOT / "docs" / "operating.md").read_text()
    table = text.split("## Events in `metrics.jsonl`", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = line.split("|")
        if len(cells) > 2:
            for kind in re.findall(r"`([a-z_]+)`", cells[1]):
                rows[kind] = line
    return rows


def test_the_code_writes_the_events_this_test_expects():
    kinds = events_in_code()
    assert {"merge", "eval", "window", "upload_acked", "learner_dead", "draining"} <= set(kinds)
    assert "step_norm" in kinds["merge"]


def test_every_event_kind_and_field_is_documented():
    doc = events_in_doc()
    missing_kinds = sorted(set(events_in_code()) - set(doc))
    assert not missing_kinds, f"event kinds written by the code but not in docs/operating.md: {missing_kinds}"
    missing_fields = {
        kind: sorted(f for f in fields if f"`{f}`" not in doc[kind]) for kind, fields in events_in_code().items()
    }
    missing_fields = {k: v for k, v in missing_fields.items() if v}
    assert not missing_fields, f"fields written by the code but not in docs/operating.md: {missing_fields}"


def test_no_documented_event_is_gone_from_the_code():
    stale = sorted(set(events_in_doc()) - set(events_in_code()))
    assert not stale, f"docs/operating.md documents events the code no longer writes: {stale}"
