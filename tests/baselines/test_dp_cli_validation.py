"""`ddiloco dp` refuses a bad flag in one line, ``ddiloco dp: error: <flag>: <what is allowed>``
with exit code 2, before any rank starts: no traceback after the ranks started, no process
per rank of an unchecked world size."""

from __future__ import annotations

import argparse

import pytest

from ddiloco import cli
from ddiloco.baselines import cli as dp_cli
from ddiloco.baselines import launch
from ddiloco.common import cliargs, pacing


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if a rank would be started, here or by the launcher."""
    def started(*_a, **_k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "launch_dp", started)
    monkeypatch.setattr(dp_cli, "setup_logging", started)  # the first thing a --rank process does


def dp(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``ddiloco dp ARGV`` in this process."""
    try:
        rc = cli.main(["dp", "--max-tokens", "1000", *argv])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    return rc, capsys.readouterr().err


def type_error(fn, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        fn(text)
    return str(exc.value)


def test_a_master_port_out_of_range_is_refused(capsys, nothing_starts):
    # was: ValueError: Port out of range, a traceback 4.5 s after the ranks started
    rc, err = dp(capsys, "--world-size", "2", "--master-port", "99999")
    assert rc == 2
    assert err == f"ddiloco dp: error: argument --master-port: {type_error(cliargs.port, '99999')}\n"


@pytest.mark.parametrize("value", ["0", "nan", "inf", "-1", "1e18", "0.0005"])
def test_a_collective_timeout_must_be_positive_finite_and_at_most_30_days(capsys, nothing_starts, value):
    # was: DistNetworkError (0), ValueError (nan), OverflowError (inf, 1e18) in every rank
    rc, err = dp(capsys, "--world-size", "2", "--collective-timeout", value)
    assert rc == 2
    assert err == f"ddiloco dp: error: argument --collective-timeout: seconds from 0.001 to 2592000 (30 days), got {value}\n"


def test_a_collective_timeout_in_range_is_taken():
    assert dp_cli.collective_timeout("0.001") == 0.001 and dp_cli.collective_timeout("2592000") == 2592000


def test_step_seconds_beyond_any_bound_are_refused(capsys, nothing_starts):
    # was: the run started, then an OverflowError at its first step's sleep
    with pytest.raises(ValueError) as exc:
        pacing.check(step_seconds=1e18)
    rc, err = dp(capsys, "--world-size", "2", "--step-seconds", "1e18")
    assert rc == 2
    assert err == f"ddiloco dp: error: --step-seconds: {exc.value}\n"


def test_a_step_must_be_shorter_than_the_collective_timeout(capsys, nothing_starts):
    rc, err = dp(capsys, "--world-size", "2", "--collective-timeout", "30", "--step-seconds", "30")
    assert rc == 2
    assert err == ("ddiloco dp: error: --step-seconds: below --collective-timeout (30 s): "
                   "a step cannot outlast the wait for its peers, got 30\n")


@pytest.mark.parametrize("world", ["0", "-3", "100000"])
def test_ranks_started_here_are_bounded_by_this_machines_memory(capsys, nothing_starts, world):
    # was: 100000 started a process per rank (176 in 20 s); 0 a bare line with exit code 1
    limit = dp_cli.local_rank_limit()
    assert 1 <= limit < 100000
    rc, err = dp(capsys, "--world-size", world)
    assert rc == 2
    assert err == (f"ddiloco dp: error: --world-size: 1 to {limit:,} ranks started here (each a process of at least "
                   f"256 MiB, in this machine's memory; more: one rank per host with --rank), got {world}\n")


def test_one_rank_of_a_larger_world_is_bounded_as_a_runs_learners(capsys, nothing_starts):
    rc, err = dp(capsys, "--rank", "0", "--world-size", "1000001", "--master-port", "29500")
    assert rc == 2
    assert err == "ddiloco dp: error: --world-size: an integer from 1 to 1,000,000, got 1000001\n"


@pytest.mark.parametrize("rank", ["5", "2", "-1"])
def test_a_rank_outside_the_world_is_an_argparse_error(capsys, nothing_starts, rank):
    # was: "--rank must be in [0, 2), got 5", bare, exit code 1
    rc, err = dp(capsys, "--world-size", "2", "--rank", rank, "--master-port", "29500")
    assert rc == 2
    assert err == f"ddiloco dp: error: --rank: 0 to 1 (--world-size 2), got {rank}\n"


def test_a_rank_needs_the_master_port(capsys, nothing_starts):
    rc, err = dp(capsys, "--world-size", "2", "--rank", "0")
    assert rc == 2
    assert err == "ddiloco dp: error: --master-port: required with --rank, 1 to 65535, the same on every rank\n"


def test_a_bad_run_flag_is_an_argparse_error_too(capsys, nothing_starts):
    rc, err = dp(capsys, "--world-size", "2", "--inner-steps", "0")
    assert rc == 2
    assert err.startswith("ddiloco dp: error: --inner-steps") and err.count("\n") == 1
