"""Helpers shared by the test folders. A plain module with a unique name: `conftest` is
ambiguous as an import once several test folders have one."""

from __future__ import annotations

import ast
import contextlib
import fcntl
import importlib.util
import os
import pathlib
import re
import sys
import tempfile
import time

from ddiloco.common.health import check

def parse_python(source: str) -> ast.Module:
    """``ast.parse``, immune to a CPython 3.11 race: the AST converter keeps its recursion
    depth in state shared by every thread, and 3.11 itself calls ``ast.parse`` to place the
    carets of every traceback it formats. A traceback logged in another thread (a gRPC
    request thread, a service loop) while this thread converts a tree makes the conversion
    fail with ``SystemError: AST constructor recursion depth mismatch`` although the source
    is fine. That error alone is retried; a syntax error, or the same SystemError five times
    in a row, still fails."""
    for _ in range(4):
        try:
            return ast.parse(source)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e):
                raise
    return ast.parse(source)  # the fifth try: whatever it raises, the caller sees


# A command run with SIGINT as a terminal leaves it to its foreground job (a suite started in
# the background, ``&`` in a non-interactive shell, hands SIGINT on ignored, and an ignored
# SIGINT stays ignored across exec, so Python would install no KeyboardInterrupt handler):
# a fresh interpreter sets it back to its default, then execs the command in its own place
# (same pid). Not ``preexec_fn``: that makes subprocess fork the test process itself, which
# holds gRPC's threads from earlier tests, and a fork there can hang the child in gRPC's
# fork handlers before it ever runs the command.
_SIGINT_DEFAULT_EXEC = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def with_sigint_default(python_args: list[str]) -> list[str]:
    """The argv that runs ``python python_args...`` with SIGINT at its default (above)."""
    return [sys.executable, "-c", _SIGINT_DEFAULT_EXEC, *python_args]


# A tiny model and short windows keep every multi-process test within seconds on 2 cores.
TINY_RUN = ["--model", "tiny", "--inner-steps", "5", "--batch-size", "4", "--data-bytes", "600000", "--eval-interval", "2"]


def load_bench(name: str, module_name: str | None = None):
    """The bench script ``bench/NAME.py`` as a module (benches are scripts, not a package),
    registered in ``sys.modules`` under ``module_name`` (dataclasses look their module up
    there); ``bench/`` goes on the path for the scripts' own ``import common_bench``."""
    bench_dir = pathlib.Path(__file__).resolve().parents[1] / "bench"
    if str(bench_dir) not in sys.path:
        sys.path.insert(0, str(bench_dir))
    spec = importlib.util.spec_from_file_location(module_name or f"{name}_bench", bench_dir / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll a condition (never a bare sleep standing in for synchronisation)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def assert_provenance(prov: dict) -> None:
    """What every bench result records of where and when it ran (``bench/common_bench.py``):
    the commit at start, whether ``services/`` or ``bench/`` had uncommitted changes (with the
    diff's hash exactly when they had), the load average at start and end, and whether the
    start was quiet enough to commit the result."""
    assert re.fullmatch(r"[0-9a-f]{40}", prov["git_rev"]), prov.get("git_rev")
    assert isinstance(prov["dirty"], bool) and prov["dirty"] == (prov["diff_sha256"] is not None), prov
    assert prov["dirty"] == bool(prov["dirty_files"]), prov
    for key in ("load_average_start", "load_average_end"):
        assert len(prov[key]) == 3 and all(x >= 0 for x in prov[key]), (key, prov[key])
    assert prov["load_ok"] == (prov["load_average_start"][0] <= 1.5), prov


def wait_serving(address: str, timeout: float = 120.0) -> None:
    wait_until(lambda: check(address, timeout=1.0)[0], timeout, f"{address} to answer SERVING")


def read_pty(fd: int) -> bytes:
    """Everything written to a pseudo-terminal until every writer has closed it."""
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def processes_naming(text: str) -> list[int]:
    """Pids of live processes whose command line holds ``text`` (the run folder)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((line for line in (entry / "status").read_text().splitlines() if line.startswith("State:")), "")
        except OSError:  # gone meanwhile
            continue
        if text in cmdline and "zombie" not in state:
            found.append(int(entry.name))
    return found


HOST_WIDE_LOCK = pathlib.Path(tempfile.gettempdir()) / "ddiloco-tests-host-wide.lock"


_taken_here: dict[pathlib.Path, list] = {}  # path -> [open lock file, depth] in this process


@contextlib.contextmanager
def host_wide_lock(path: pathlib.Path = HOST_WIDE_LOCK):
    """Exclusive use of what is host-wide (the Docker engine, network namespaces, tc) among
    test processes: the suite's xdist workers take it file by file (tests/conftest.py).

    Re-entrant within a process: a session fixture torn down after a worker's last test (the
    Docker engine's stop) takes it while that test, a host-wide file's, still holds it; a
    second flock on another open of the file would wait for this very process forever."""
    entry = _taken_here.get(path)
    if entry is None:
        f = open(path, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        entry = _taken_here[path] = [f, 0]
    entry[1] += 1
    try:
        yield
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del _taken_here[path]
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            entry[0].close()


TESTS = pathlib.Path(__file__).resolve().parent

# The order the two workers take test files in. xdist would queue files by their number of
# tests, so the few-test files that run longest (the quick benches, the Compose and Swarm runs)
# came last: both workers then waited for one another at the end, on the host-wide lock
# (measured: 101 s of a 916 s run) or on one long file alone. Longest first instead (a
# longest-processing-time schedule), the host-wide ones alternating with others so that the
# two workers rarely want the lock at once; every other file follows, most tests first as
# before. Approximate seconds per file on 2 cores, from `--durations` runs; the order is all
# that matters (tests/test_host_wide_lock.py checks that every file named here exists).
# tests/conftest.py applies it; it lives here so that a test can import it by this module's
# unique name (several folders have a conftest).
LONG_FILES = (
    "bench/test_chaos_quick.py",  # ~190 s
    "bench/test_bandwidth_quick.py",  # host-wide, ~80 s
    "learner/test_learner_group.py",  # ~75 s
    "docker/test_docker_compose_e2e.py",  # host-wide, ~75 s
    "chaos/test_coordinator_kill.py",  # ~55 s
    "docker/test_docker_swarm_e2e.py",  # host-wide, ~70 s
    "launcher/test_resume.py",  # ~50 s
    "docker/test_docker_monitoring_e2e.py",  # host-wide, ~45 s
    "bench/test_merge_ablation_quick.py",  # ~47 s
    "netns/test_shaped_run.py",  # host-wide, ~30 s
    "chaos/test_outer_restart_quality.py",  # ~45 s
    "chaos/test_outer_shard_kill.py",  # ~44 s
    "workloads/test_examples.py",  # ~41 s
    "launcher/test_end_to_end.py",  # ~40 s
    "workloads/test_hf.py",  # ~39 s
    "bench/test_peer_diloco_quick.py",  # ~33 s
    "launcher/test_fragments_and_mixed_speed.py",  # ~30 s
    "bench/test_learner_overhead_quick.py",  # ~30 s
)


def file_of(item) -> str:
    """``item``'s file, relative to tests/."""
    return pathlib.Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()


def order_files(items: list) -> list:
    """``items`` with whole files in the order above: the long ones first, then the rest by
    their number of tests, most first (xdist's own order). Stable within a file."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(file_of(item), []).append(item)
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    ordered = sorted(files, key=lambda f: (0, rank[f]) if f in rank else (1, -len(files[f])))
    return [item for f in ordered for item in files[f]]


def closed_within(sock, seconds: float) -> bool:
    """Whether the server closes ``sock`` (sending nothing) within ``seconds``."""
    import socket

    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except (socket.timeout, BlockingIOError):  # nothing came: still open
        return False


def connect(port: int, source: str = "127.0.0.1"):
    """A TCP connection to 127.0.0.1:``port`` from the address ``source`` (127.0.0.x: a client
    address of its own, for per-address bounds)."""
    import socket

    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def http_answer(port: int, path: str, source: str | None = None) -> tuple[int, str | None]:
    """(status, Retry-After) of one GET of ``path`` at 127.0.0.1:``port``, from the address
    ``source`` (default: the system's choice)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(source, 0) if source else None)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, answer.getheader("Retry-After")
    finally:
        conn.close()


def cli_refused(tmp_path: pathlib.Path, argv: list[str], env: dict | None = None) -> str:
    """Run ``ddiloco ARGV`` in ``tmp_path`` and return its one line of error: it must exit 2
    with that one line, no traceback, and nothing created in ``tmp_path`` (refused before
    anything started)."""
    import subprocess

    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    proc = subprocess.run([sys.executable, "-m", "ddiloco", *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=20, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing created
    err = proc.stderr.strip()
    assert "\n" not in err, f"more than one line: {err!r}"
    return err
