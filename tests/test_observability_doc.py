"""docs/observability.md lists every Prometheus metric the services define: the names are
read from the code (every ``ddiloco_...`` string in a ``prom.py``), the table from the doc."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def metric_names_in_code() -> set[str]:
    names = set()
    for path in (ROOT / "services" / "ddiloco").rglob("prom.py"):
        names.update(re.findall(r'"(ddiloco_[a-z_]+)"', path.read_text()))
    return names


def test_the_code_defines_the_metrics_this_test_expects():
    names = metric_names_in_code()
    assert {"ddiloco_outer_merge_deltas", "ddiloco_learner_step_seconds", "ddiloco_coordinator_learner_state"} <= names


def test_every_metric_is_documented():
    doc = (ROOT / "docs" / "observability.md").read_text()
    documented = set(re.findall(r"\| `(ddiloco_[a-z_]+)` \|", doc))
    # counters from collectors are named without `_total` in code; the doc shows what a scrape shows
    missing = sorted(n for n in metric_names_in_code() if n not in documented and n + "_total" not in documented)
    assert not missing, f"metrics defined in the code but not in docs/observability.md: {missing}"
