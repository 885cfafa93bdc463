"""`ddiloco run`'s progress display (ddiloco.launcher.progress): a tqdm bar over the run's
budget on a terminal (a real pseudo-terminal here), the plain line anywhere else."""

from __future__ import annotations

import fcntl
import io
import os
import select
import struct
import termios

from ddiloco.launcher.progress import Bar, Lines, Snapshot, plain_line

SNAP = Snapshot(elapsed_s=30.0, state="running", tokens=1_250_000, loss="3.412", version="57",
                up_bytes=12_300_000, down_bytes=11_000_000, alive=3, members=4)


def terminal() -> tuple[int, int]:
    """A pseudo-terminal of 40 rows and 160 columns, as a window would set (a fresh one has 0x0)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    return master, slave


def read_all(fd: int) -> str:
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        out += os.read(fd, 65536)
    return out.decode(errors="replace")


def test_on_a_terminal_a_bar_shows_the_share_of_the_time_budget_and_the_run():
    master, slave = terminal()
    with os.fdopen(slave, "w") as tty:
        assert tty.isatty()
        bar = Bar(tty, max_seconds=120.0, max_tokens=0)
        bar.show(SNAP)
        text = read_all(master)
        bar.close()
    os.close(master)
    assert " 25%|" in text  # 30 s of 120
    assert "running" in text and "loss 3.412" in text and "v57" in text and "learners 3/4" in text


def test_a_terminal_that_reports_no_size_still_gets_a_bar():
    master, slave = os.openpty()  # 0 rows, 0 columns, as `script` in CI gives
    with os.fdopen(slave, "w") as tty:
        bar = Bar(tty, max_seconds=120.0, max_tokens=0)
        bar.show(SNAP)
        text = read_all(master)
        bar.close()
    os.close(master)
    assert " 25%|" in text and "loss 3.412" in text


def test_with_a_token_budget_the_bar_counts_tokens():
    master, slave = terminal()
    with os.fdopen(slave, "w") as tty:
        bar = Bar(tty, max_seconds=600.0, max_tokens=5_000_000)
        bar.show(SNAP)
        text = read_all(master)
        bar.close()
    os.close(master)
    assert " 25%|" in text and "5.00M" in text  # 1.25M of 5M tokens


def test_elsewhere_the_plain_line_is_kept():
    stream = io.StringIO()
    Lines(stream).show(SNAP)
    assert stream.getvalue() == plain_line(SNAP) + "\n"
    assert plain_line(SNAP) == (
        "[  30.0s running] tokens   1.25M  eval loss 3.412  version 57  up   12.3MB down   11.0MB  learners 3/4"
    )
