"""The argument types every command shares (``common/cliargs.py``): what each takes, and the
words of a refusal, which argparse prints after the flag's name (before, a duration's words
were dropped: "invalid duration value: '-5'")."""

from __future__ import annotations

import argparse
import math
import os

import pytest

from ddiloco.common.cliargs import BadValue, bind_address, duration, log_level, run_folder, threads


def test_a_refusal_keeps_its_words_and_is_a_value_error_outside_argparse(capsys):
    parser = argparse.ArgumentParser(prog="ddiloco x")
    parser.add_argument("--max-seconds", type=duration)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-seconds", "-5"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "ddiloco x: error: argument --max-seconds: not a duration: '-5' (examples: 60s, 1.5m, 500ms, 20, inf)"
    )
    with pytest.raises(ValueError):  # a --fault spec parses durations outside argparse
        duration("soon")
    assert (duration("1.5m"), duration("500ms"), duration("inf")) == (90.0, 0.5, math.inf)


def test_a_run_folder_exists_as_a_folder_or_can_be_made(tmp_path):
    assert run_folder(str(tmp_path)) == tmp_path
    assert run_folder(str(tmp_path / "new" / "deeper")) == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # checked, not made
    (tmp_path / "f").write_text("")
    for path, words in ((tmp_path / "f", "is a file, not a folder"), (tmp_path / "f" / "x", "cannot be created")):
        with pytest.raises(BadValue, match=words):
            run_folder(str(path))
    with pytest.raises(BadValue, match="empty path"):
        run_folder(" ")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(BadValue, match="is not writable"):
            run_folder(str(locked / "run"))


def test_log_levels_threads_and_listen_addresses():
    assert log_level("debug") == "DEBUG"
    with pytest.raises(BadValue, match="one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'BOGUS'"):
        log_level("BOGUS")
    assert threads("4") == 4
    for bad in ("0", "-5", "2000", "x"):
        with pytest.raises(BadValue):
            threads(bad)
    assert bind_address("127.0.0.1:0") == "127.0.0.1:0" and bind_address("[::1]:50051") == "[::1]:50051"
    for bad, words in (("127.0.0.1:99999", "0 (any free one) to 65535, got 99999"), ("nonsense", "HOST:PORT"),
                       ("127.0.0.1:-1", "HOST:PORT"), (":50051", "HOST:PORT")):
        with pytest.raises(BadValue, match=words.replace("(", r"\(").replace(")", r"\)")):
            bind_address(bad)
