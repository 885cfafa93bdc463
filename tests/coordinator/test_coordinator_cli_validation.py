"""``ddiloco coordinator``'s flags: a --port-file it cannot write and a --reopen with no
saved run are one error line and exit code 2 before anything starts (no traceback, nothing
created). Before, the first was a StorageError traceback after the server had started, and
the second silently started a fresh run (creating the folder)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from support import cli_refused

E = "ddiloco coordinator: error: "
BASE = ["--bind", "127.0.0.1:0", "--model", "tiny", "--learners", "1", "--insecure"]


def _refused(tmp_path, args: list[str]) -> str:
    return cli_refused(tmp_path, ["coordinator", *BASE, *args])


def test_a_port_file_whose_folder_cannot_be_made_is_refused_before_the_server_starts(tmp_path):
    (tmp_path / "afile").write_text("x")
    assert _refused(tmp_path, ["--run-dir", "c1", "--port-file", "afile/port"]) == (
        E + "--port-file: its folder: 'afile' is a file, not a folder")


def test_a_port_file_that_is_a_folder_is_refused(tmp_path):
    (tmp_path / "adir").mkdir()
    assert _refused(tmp_path, ["--run-dir", "c1", "--port-file", "adir"]) == E + "--port-file: 'adir' is a folder, not a file"


@pytest.mark.parametrize("folder", ["missing", "empty", "no-state"])
def test_reopen_refuses_a_run_dir_without_a_saved_run(tmp_path, folder):
    if folder == "empty":
        (tmp_path / folder).mkdir()
    if folder == "no-state":  # a run folder whose coordinator never saved its state
        (tmp_path / folder / "coordinator").mkdir(parents=True)
        (tmp_path / folder / "config.json").write_text("{}")
    assert _refused(tmp_path, ["--reopen", "--run-dir", folder]) == (
        E + f"--reopen: {folder} holds no saved run (coordinator/state.json)")


def test_a_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    assert _refused(tmp_path, ["--run-dir", "afile"]) == E + "argument --run-dir: 'afile' is a file, not a folder"


def test_the_port_files_folder_is_created_as_the_run_dir_is(tmp_path):
    """``--run-dir R --port-file R/port`` for a new R, and a port file in a new folder of its own."""
    port_file = tmp_path / "new" / "sub" / "coordinator.port"
    proc = subprocess.Popen([sys.executable, "-m", "ddiloco", "coordinator", *BASE, "--run-dir", str(tmp_path / "run"),
                             "--port-file", str(port_file)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert port_file.exists(), proc.stderr.read() if proc.poll() is not None else "no port file in 20 s"
        assert int(port_file.read_text()) > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=20)[1]
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err


def test_an_address_it_cannot_listen_on_is_one_line_not_a_traceback(tmp_path):
    """gRPC's RuntimeError ("Failed to bind to address") was a traceback; a port in use is
    the common case (a second coordinator on one host)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [a if a != "127.0.0.1:0" else f"127.0.0.1:{port}" for a in BASE]
        proc = subprocess.run([sys.executable, "-m", "ddiloco", "coordinator", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=20)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"ddiloco coordinator: cannot start: cannot listen on 127.0.0.1:{port}: in use" in proc.stderr
