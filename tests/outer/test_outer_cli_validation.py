"""``ddiloco outer``'s flags: an address or number the outer optimizer cannot use is one
error line and exit code 2 before anything starts (no traceback, nothing created); before,
an empty --coordinator was a gRPC traceback 5 s after start ("target uri is not valid")."""

from __future__ import annotations


import pytest
from support import cli_refused

from ddiloco.cli import OneLineErrors
from ddiloco.outer import cli

NOWHERE = ["--coordinator", "127.0.0.1:1", "--insecure"]  # nothing listens there
E = "ddiloco outer: error: "


def _refused(tmp_path, args: list[str]) -> str:
    return cli_refused(tmp_path, ["outer", *args])


@pytest.mark.parametrize("address", ["", "localhost", "host:0", "host:99999", "::1:50051"])
def test_a_coordinator_address_that_is_not_host_port_is_refused(tmp_path, address):
    assert _refused(tmp_path, ["--coordinator", address, "--insecure", "--run-dir", "run"]) == (
        E + f"argument --coordinator: HOST:PORT with a port from 1 to 65535, got {address!r}")


@pytest.mark.parametrize("args, message", [
    (["--shard", "-1"], "argument --shard: a shard from 0 to the run's --outer-shards minus 1 (at most 1023), got -1"),
    (["--advertise", "outer"], "argument --advertise: HOST:PORT with a port from 1 to 65535, got 'outer'"),
    (["--threads", "-2"], "argument --threads: a whole number of threads, 1 to 1024, got -2"),
])
def test_a_value_the_outer_optimizer_cannot_use_is_refused_before_it_starts(tmp_path, args, message):
    assert _refused(tmp_path, NOWHERE + ["--run-dir", "run"] + args) == E + message


def test_a_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    assert _refused(tmp_path, NOWHERE + ["--run-dir", "afile"]) == E + "argument --run-dir: 'afile' is a file, not a folder"


def test_the_values_an_outer_optimizer_can_use_are_taken():
    parser = OneLineErrors(prog="ddiloco outer")
    cli.add_arguments(parser)
    a = parser.parse_args(["--coordinator", "coordinator:50051", "--advertise", "[fd00::2]:50052", "--shard", "3"])
    assert (a.coordinator, a.advertise, a.shard) == ("coordinator:50051", "[fd00::2]:50052", 3)
    assert parser.parse_args([]).advertise == ""
