"""Start the W ranks of a data-parallel run as local processes and wait for them.

Each rank is ``python -m ddiloco dp --rank R ...``, optionally behind a command prefix
(``wrap_for_rank``), e.g. ``["ip", "netns", "exec", "dc0"]`` to put rank 0 in network
namespace dc0: then ``master_addr`` must be an address rank 0 can bind and the others
can reach.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

from ddiloco.common.interrupts import StopSignals

# one busy thread per process, as for ddiloco's learners: several ranks share few cores
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class DPFailed(RuntimeError):
    pass


def free_port(host: str) -> int:
    """A port that was free a moment ago (rank 0 binds it; a clash fails loudly, not silently)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("", "0.0.0.0") else "127.0.0.1", 0))
        return s.getsockname()[1]


def rank_command(rank: int, world_size: int, out: pathlib.Path, master_addr: str, master_port: int,
                 run_flags: list[str], extra: list[str] | None = None) -> list[str]:
    return [
        sys.executable, "-m", "ddiloco", "dp",
        "--rank", str(rank), "--world-size", str(world_size),
        "--master-addr", master_addr, "--master-port", str(master_port),
        "--out", str(out), *(extra or []), *run_flags,
    ]


def launch_dp(
    out: pathlib.Path,
    world_size: int,
    run_flags: list[str],
    wrap_for_rank: Callable[[int], list[str]] | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    extra_flags: list[str] | None = None,
    timeout_s: float = 7200.0,
) -> dict:
    """Run W ranks to the end of their budget; return rank 0's report (``out/report.json``).

    ``run_flags`` are the shared run flags (``--model tiny --max-tokens ...``); ``extra_flags``
    go to every rank too (``--device cuda``). Raises ``DPFailed`` naming the rank and its log
    when a rank fails; the other ranks are then stopped rather than left waiting in an
    all-reduce. ``master_port`` 0 picks a free one on this machine.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").unlink(missing_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    port = master_port or free_port(master_addr)
    env = {**os.environ, **CHILD_ENV}
    src = str(pathlib.Path(__file__).resolve().parents[2])  # works from a checkout without install
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    procs: list[tuple[int, subprocess.Popen, pathlib.Path]] = []
    # ranks run in sessions of their own: SIGTERM/SIGHUP, like Ctrl-C, must reach the
    # finally below, or they would train on without the launcher (common/interrupts.py)
    with StopSignals() as signals:
        try:
            for r in range(world_size):
                cmd = (wrap_for_rank(r) if wrap_for_rank else []) + rank_command(
                    r, world_size, out, master_addr, port, run_flags, extra_flags
                )
                log_path = logs / f"rank-{r}.log"
                with open(log_path, "ab") as log:
                    popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                procs.append((r, popen, log_path))
            _wait(procs, timeout_s)
        finally:
            signals.stopping()
            _stop(procs)
    report_path = out / "report.json"
    if not report_path.exists():
        raise DPFailed(f"rank 0 wrote no report; see {logs}/rank-0.log")
    return json.loads(report_path.read_text())


def _wait(procs: list[tuple[int, subprocess.Popen, pathlib.Path]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [(r, p.poll(), log) for r, p, log in procs]
        failed = [(r, c, log) for r, c, log in codes if c not in (None, 0)]
        if failed:
            r, c, log = failed[0]
            raise DPFailed(f"rank {r} exited with {c}; see {log}\n{_tail(log)}")
        if all(c == 0 for _, c, _ in codes):
            return
        if time.monotonic() > deadline:
            raise DPFailed(f"data-parallel run did not finish within {timeout_s:.0f}s")
        time.sleep(0.2)  # polling the children's exit, not synchronisation between them


def _stop(procs: list[tuple[int, subprocess.Popen, pathlib.Path]], grace: float = 10.0) -> None:
    alive = [p for _, p, _ in procs if p.poll() is None]
    for p in alive:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=5)


def _tail(path: pathlib.Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
