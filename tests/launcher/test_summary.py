"""The end-of-run summary table: every figure of report.json as written, and an initial loss
the outer optimizer no longer knows (its record lost across a restart) shown as unknown,
never as a loss of 0."""

from __future__ import annotations

import io

from ddiloco.launcher.cli import print_summary

REPORT = {
    "initial_eval_loss": 5.49258, "final_eval_loss": 1.61234, "final_eval_accuracy": 0.5321,
    "tokens_trained": 1_234_567, "outer_steps": 42, "bytes_uploaded": 12_000_000, "bytes_downloaded": 9_000_000,
    "wall_seconds": 181.26, "model_parameters": 1_900_000,
    "learners": [{"learner_id": 0, "tokens": 617_000, "inner_steps": 600, "deltas_sent": 27, "deltas_accepted": 30, "deltas_merged": 29,
                  "incarnations": 1}],
}


def _summary(report: dict) -> str:
    out = io.StringIO()
    print_summary(report, out)
    return out.getvalue()


def test_the_summary_shows_each_figure_of_the_report():
    text = _summary(REPORT)
    assert "| eval loss | 5.4926 -> 1.6123 |" in text
    assert "| eval metric (accuracy) | 53.21% |" in text
    assert "| tokens trained | 1,234,567 |" in text and "| outer steps | 42 |" in text
    assert "| uploaded / downloaded | 12.00 MB / 9.00 MB |" in text
    assert "| learner | tokens | inner steps | deltas accepted | deltas merged | incarnations |" in text
    # the outer optimizer's counts, not the learner's own (27: a killed incarnation's last
    # heartbeat interval is lost, which would show fewer sent than merged)
    assert "| 0 | 617,000 | 600 | 30 | 29 | 1 |" in text


def test_an_unknown_initial_loss_is_shown_as_unknown():
    assert "| eval loss | unknown -> 1.6123 |" in _summary({**REPORT, "initial_eval_loss": None})


def test_the_runs_overlap_is_a_row_when_known():
    out = io.StringIO()
    print_summary(REPORT, out, "1.13 of 20.0 steps per window trained on the old base before its merge arrived (median, 6%)")
    assert "| overlap | 1.13 of 20.0 steps per window trained on the old base" in out.getvalue()
    assert "| overlap |" not in _summary(REPORT)
