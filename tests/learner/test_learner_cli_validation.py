"""``ddiloco learner``'s flags: a value the learner cannot use is one error line and exit
code 2 before anything starts (no traceback, nothing created, no coordinator dialed); before,
some failed only after joining (a negative batch size, an id beyond int32), or were taken
silently (a negative H uploaded every step; a --state-dir that is a file lost the optimizer
state every H steps)."""

from __future__ import annotations


import pytest
from support import cli_refused

from ddiloco.cli import OneLineErrors
from ddiloco.learner import cli

# nothing listens there: a learner that got past its flags would retry for minutes
NOWHERE = ["--coordinator", "127.0.0.1:1", "--insecure"]
E = "ddiloco learner: error: "


def _refused(tmp_path, args: list[str], env: dict | None = None) -> str:
    return cli_refused(tmp_path, ["learner", *args], env)


@pytest.mark.parametrize("args, message", [
    (["--learner-id", "99999999999"], "argument --learner-id: -1 (any free id) or an id from 0 to 2147483647, got 99999999999"),
    (["--learner-id", "-2"], "argument --learner-id: -1 (any free id) or an id from 0 to 2147483647, got -2"),
    (["--batch-size", "-3"], "argument --batch-size: 0 (the run's) or an integer from 1 to 65536, got -3"),
    (["--batch-size", "65537"], "argument --batch-size: 0 (the run's) or an integer from 1 to 65536, got 65537"),
    (["--inner-steps", "-5"], "argument --inner-steps: 0 (the run's) or an integer from 1 to 1048576, got -5"),
    (["--inner-steps", "ten"], "argument --inner-steps: 0 (the run's) or an integer from 1 to 1048576, got 'ten'"),
    (["--advertise", "myhost"], "argument --advertise: HOST:PORT with a port from 1 to 65535, got 'myhost'"),
    (["--threads", "0"], "argument --threads: a whole number of threads, 1 to 1024, got 0"),
])
def test_a_number_the_learner_cannot_use_is_refused_before_it_starts(tmp_path, args, message):
    assert _refused(tmp_path, NOWHERE + args) == E + message


@pytest.mark.parametrize("address", ["", "localhost", "host:0", "host:65536", "::1:50051", "host :1"])
def test_a_coordinator_address_that_is_not_host_port_is_refused(tmp_path, address):
    assert _refused(tmp_path, ["--coordinator", address, "--insecure"]) == (
        E + f"argument --coordinator: HOST:PORT with a port from 1 to 65535, got {address!r}")


def test_a_state_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    assert _refused(tmp_path, NOWHERE + ["--state-dir", "afile"]) == E + "argument --state-dir: 'afile' is a file, not a folder"
    assert _refused(tmp_path, NOWHERE + ["--state-dir", "afile/sub"]) == (
        E + f"argument --state-dir: 'afile/sub' cannot be created: {tmp_path / 'afile'} is a file")


def test_the_default_state_dir_under_the_run_dir_is_checked_too(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "learner-state").write_text("x")
    assert _refused(tmp_path, NOWHERE + ["--run-dir", "run"]) == (
        E + "--state-dir (default RUN_DIR/learner-state): 'run/learner-state' is a file, not a folder")


def test_an_environment_value_is_checked_as_the_flag_is(tmp_path):
    import os

    env = dict(os.environ, DDILOCO_INNER_STEPS="-5")
    assert _refused(tmp_path, NOWHERE, env=env).startswith(
        E + "DDILOCO_INNER_STEPS='-5': not a valid inner_steps for --inner-steps (0 (the run's) or an integer from 1 to")


def _parse(args: list[str]):
    parser = OneLineErrors(prog="ddiloco learner")
    cli.add_arguments(parser)
    return parser.parse_args(args)


def test_the_values_a_learner_can_use_are_taken():
    a = _parse(["--coordinator", "[::1]:50051", "--learner-id", "2147483647", "--batch-size", "65536",
                "--inner-steps", "1", "--state-dir", "", "--advertise", "learner-3:7000"])
    assert (a.coordinator, a.learner_id, a.batch_size, a.inner_steps, a.state_dir) == ("[::1]:50051", 2147483647, 65536, 1, "")
    a = _parse(["--coordinator", "coordinator:50051", "--learner-id", "-1", "--batch-size", "0", "--inner-steps", "0"])
    assert (a.learner_id, a.batch_size, a.inner_steps) == (-1, 0, 0)
