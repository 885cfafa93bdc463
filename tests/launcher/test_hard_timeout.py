"""The launcher's hard stop for a wedged run follows the run's own budget."""

from ddiloco.common.config import RunConfig
from ddiloco.launcher.run import LaunchOptions, hard_timeout_s, supervision_timeout_s


def test_hard_timeout_covers_start_up_budget_drain_and_margin():
    cfg = RunConfig(max_seconds=7200.0, drain_timeout_s=90.0)
    timeout = hard_timeout_s(cfg)
    assert timeout > 7200.0 + 90.0
    # a longer budget or drain moves the hard stop by as much
    assert hard_timeout_s(RunConfig(max_seconds=7300.0, drain_timeout_s=90.0)) == timeout + 100.0
    assert hard_timeout_s(RunConfig(max_seconds=7200.0, drain_timeout_s=100.0)) == timeout + 10.0


def test_a_two_hour_budget_is_not_stopped_after_an_hour(tmp_path, monkeypatch):
    monkeypatch.delenv("DDILOCO_MAX_SECONDS", raising=False)
    options = LaunchOptions(out=tmp_path, run_flags=["--max-seconds", "7200"], learners=1)
    assert supervision_timeout_s(options) == hard_timeout_s(RunConfig(max_seconds=7200.0))


def test_the_budget_from_the_environment_counts_as_the_coordinator_reads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DDILOCO_MAX_SECONDS", "3h")
    options = LaunchOptions(out=tmp_path, run_flags=[], learners=1)
    assert supervision_timeout_s(options) == hard_timeout_s(RunConfig(max_seconds=3 * 3600.0))


def test_an_explicit_timeout_wins(tmp_path):
    options = LaunchOptions(out=tmp_path, run_flags=["--max-seconds", "7200"], learners=1, timeout_s=30.0)
    assert supervision_timeout_s(options) == 30.0
