"""The progress display of ``ddiloco run``: the spent share of the budget and the time to
its end, live within 80 columns on a terminal (a real pseudo-terminal here), one plain
line per update with no control codes anywhere else. ``test_resume.py`` also checks both
modes on real runs."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import termios

import pytest

from ddiloco.launcher.progress import Budget, Progress, Snapshot, plain_line
from support import read_pty

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SNAPSHOTS = [
    Snapshot("waiting", 0.0, 0, 0, 0),
    Snapshot("running", 42.3, 1_234_567, 4, 4, version=37, loss=2.3141),
    Snapshot("running", 3599.0, 98_765_432, 15, 16, version=123_456, loss=10.5),
    Snapshot("draining", 150.2, 99_000_000, 3, 4, version=12_345, loss=1.0),
]
BUDGETS = [Budget(150.0), Budget(3600.0), Budget(3600.0, 100_000_000)]


def test_the_share_spent_is_whichever_budget_ends_first():
    s = Snapshot("running", 30.0, 4_000_000, 4, 4)
    assert Budget(150.0).spent(s) == pytest.approx(0.2)
    assert Budget(150.0, 5_000_000).spent(s) == pytest.approx(0.8)
    assert Budget(10.0).spent(s) == 1.0, "never past the end"


def test_the_eta_is_what_is_left_of_the_time_or_the_tokens_at_the_current_pace():
    s = Snapshot("running", 30.0, 4_000_000, 4, 4)
    assert Budget(150.0).seconds_left(s) == pytest.approx(120.0)
    assert Budget(150.0, 5_000_000).seconds_left(s) == pytest.approx(7.5)  # 1M tokens at 133k/s
    assert Budget(150.0).seconds_left(Snapshot("waiting", 0.0, 0, 0, 0)) is None


def test_plain_lines_fit_80_columns_and_name_budget_and_eta():
    for budget in BUDGETS:
        for s in SNAPSHOTS:
            line = plain_line(s, budget)
            assert len(line) <= 80, line
            assert "ETA" in line and "%" in line and s.state in line
    line = plain_line(SNAPSHOTS[1], Budget(150.0))
    assert line.startswith("running   42s/150s  28% ETA 01:47 | loss 2.314 | v37 | 1.23M tok | 4/4 up"), line


def test_off_a_terminal_each_update_is_one_plain_line():
    out = io.StringIO()  # not a terminal
    display = Progress(out, Budget(150.0))
    assert not display.live and display.interval_s == 10.0
    for s in SNAPSHOTS:
        display.show(s)
    display.close()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert text.splitlines() == [plain_line(s, Budget(150.0)) for s in SNAPSHOTS]


def screen_lines(raw: str) -> list[str]:
    """What each redraw puts on the terminal: the text between carriage returns/newlines."""
    return [seg for seg in re.split(r"[\r\n]", ANSI.sub("", raw)) if seg.strip()]


@pytest.mark.parametrize("columns", [120, 60])
def test_on_a_terminal_one_line_is_redrawn_in_place_within_80_columns(columns):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    stream = os.fdopen(slave, "w", encoding="utf-8")
    display = Progress(stream, Budget(150.0))
    assert display.live and display.interval_s == 1.0
    for s in SNAPSHOTS:
        display.show(s)
    display.close()
    stream.close()
    raw = read_pty(master).decode()
    os.close(master)
    assert raw.count("\n") <= 2, "one line redrawn in place, ended once when the display closes"
    assert "\r" in raw
    lines = screen_lines(raw)
    assert any("42s/150s" in line and "ETA 01:47" in line for line in lines)
    assert all(len(line) <= min(80, columns) for line in lines), [len(line) for line in lines]
