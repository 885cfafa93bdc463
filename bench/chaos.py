"""Chaos benchmark: what faults cost Decoupled DiLoCo, synchronous DiLoCo and data-parallel
training, under one fault schedule and one time budget, in one invocation.

Rows (M learners or ranks, budget T seconds, the same model, data and batch everywhere):

    ddiloco       Decoupled DiLoCo, no faults
    ddiloco       Decoupled DiLoCo under the schedule
    diloco-sync   synchronous DiLoCo (ddiloco run --sync --quorum M) under the schedule
    dp            data-parallel (gloo all-reduce every step) under the schedule: MODELLED,
                  see below
    dp            data-parallel, no faults (the measured run the model starts from)

The schedule (full run): a learner killed (SIGKILL) every 60 s and started again 20 s later,
and the outer optimizer killed twice, each time started again 5 s later, at moments chosen
for what they put at risk (issue 10):

- *backlog kill* (from T/2): the outer optimizer is frozen (SIGSTOP) for ``backlog_freeze_s``
  so that the learners' windows pile up, thawed, and killed as soon as its status shows at
  least one round of deltas (M) acknowledged but not merged yet (or after 10 s of trying);
  ``journal_replay`` on restart shows how many it had to recover. Synchronous DiLoCo merges
  the moment a round is complete, so in its run the condition is rarely seen and the kill
  falls when the 10 s run out (``backlog_condition_met`` says which);
- *checkpoint kill* (from 0.7 T): killed the moment a checkpoint is being written (its
  temporary folder exists; the state dir is polled every half millisecond); the restarted
  outer's ``temporaries_removed`` event confirms the kill landed mid-write.

For each: the eval loss just before the kill, the worst after it, and the seconds until an
evaluation is below the pre-kill loss again (``targeted_faults`` in each chaos row). The
ddiloco and diloco-sync rows are real runs with those faults injected by ``ddiloco.chaos``;
goodput, waste, ``acked_deltas_lost`` and ``deltas_applied_twice`` come from the runs' own
event logs (``ddiloco.chaos.goodput`` and ``ddiloco.chaos.audit``).

Issue 17 item 6: every row also gives ``time_to_sync_final_s``, the wall-clock seconds from
the start of training (the schedule's clock) at which its eval loss first reaches
diloco-sync's final loss under the schedule (None: never; the modelled DP row has no curve).

Emulated dedicated hardware (``--step-seconds``, default 0.1 s): every learner's and every
DP rank's step takes at least that long, the wait counted as compute (``common/pacing.py``).
M learners share this machine's two cores; without the floor a learner that waits (at
synchronous DiLoCo's barrier, or killed) gives its core to the others, which then step
faster, so waiting costs a method almost nothing here that it would cost on hardware of its
own. The floor sits above the contended step time (about 0.06 s for the tiny model, batch 8,
M = 8), so each learner steps at the emulated hardware's pace whatever the others do;
``compute_per_step_s`` per row and ``checks.emulated_step_held`` show whether it held.

DP is modelled, not run under faults: the data-parallel baseline has no checkpoint/restart,
and a synchronous job that loses a rank stops as a whole. The model is the standard one, with
assumptions that favour DP: a checkpoint every ``--dp-checkpoint-s`` seconds that costs
nothing; each learner kill stops all M ranks, loses on average half a checkpoint interval of
progress, and the job resumes once the killed rank is back (the same 20 s) plus DP's own
measured start-up; the outer-optimizer kill does not apply (DP has none). Its goodput is
``compute share x productive time / T`` and its final loss is the fault-free DP run's loss
at the step the productive time reaches (interpolated between its evaluations).

    python bench/chaos.py            # full: M=8, T=300 s, tiny model; ~30 minutes on 2 cores
    python bench/chaos.py --quick    # smoke test: M=2, T=30 s, faults every 10 s; ~4 minutes

It refuses to run with uncommitted changes in services/ or bench/ unless ``--allow-dirty``
(``--quick`` allows them), and records the git state and the load average at start and end.

Writes ``bench/results/chaos.json`` (``chaos-quick.json`` with --quick) and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "services") not in sys.path:  # runs from a plain checkout too
    sys.path.insert(0, str(ROOT / "services"))

from ddiloco.chaos.audit import audit_run  # noqa: E402
from ddiloco.chaos.faults import Schedule, periodic  # noqa: E402
from ddiloco.common.config import MODEL_PRESETS  # noqa: E402
from ddiloco.common.metrics import read_events  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
import common_bench as cb  # noqa: E402

TARGETS = {"goodput": 0.88, "loss_gap": 0.02}
# The schedule's two families of faults: the timed learner kills and the targeted outer kills
FAMILIES = ("learners", "outer")


@dataclass
class Settings:
    learners: int
    seconds: float
    kill_every: float
    restart_after: float
    outer_kill_at: float
    outer_restart_after: float
    model: str
    inner_steps: int
    batch_size: int
    dp_checkpoint_s: float
    device: str
    backlog_freeze_s: float = 6.0  # outer frozen this long before the backlog kill
    checkpoint_kill_at: float = -1.0  # < 0: 0.7 x seconds
    checkpoint_window_s: float = 40.0  # how long to watch for a checkpoint being written
    # emulated dedicated hardware (common/pacing.py): every learner's and every DP rank's step
    # takes at least this long; 0: off (the learners share the machine's cores)
    step_seconds: float = 0.0

    def run_flags(self) -> list[str]:
        return [
            "--model", self.model, "--inner-steps", str(self.inner_steps), "--batch-size", str(self.batch_size),
            "--learners", str(self.learners), "--max-seconds", str(self.seconds),
        ]

    def schedule(self) -> Schedule:
        """The timed faults: the learner kills (the outer kills are targeted, see ``targeted``)."""
        faults = periodic("kill", "learner", self.kill_every, self.restart_after, self.seconds)
        return Schedule(faults, seed=0)

    def targeted(self) -> list["TargetedFault"]:
        ckpt_at = self.checkpoint_kill_at if self.checkpoint_kill_at >= 0 else 0.7 * self.seconds
        return [
            TargetedFault("outer-backlog", self.outer_kill_at, self.outer_restart_after, freeze_s=self.backlog_freeze_s),
            TargetedFault("outer-checkpoint", ckpt_at, self.outer_restart_after, window_s=self.checkpoint_window_s),
        ]

    def describe_faults(self, families: tuple[str, ...] = FAMILIES) -> str:
        parts = []
        if "learners" in families:
            n = len(periodic("kill", "learner", self.kill_every, self.restart_after, self.seconds))
            parts.append(f"learner SIGKILL every {self.kill_every:g}s, restarted {self.restart_after:g}s later (x{n})")
        if "outer" in families:
            t = self.targeted()
            parts.append(
                f"outer SIGKILL with >= 1 round of deltas pending from {t[0].at_s:g}s (after a {t[0].freeze_s:g}s "
                f"freeze) and outer SIGKILL during a checkpoint write from {t[1].at_s:g}s, each restarted "
                f"{self.outer_restart_after:g}s later"
            )
        return "; ".join(parts) or "none"


def bench_settings(quick: bool, device: str, dp_checkpoint_s: float = 30.0) -> Settings:
    """The bench's settings: the full run (M = 8, 300 s, emulated 0.1 s steps) or its smoke form."""
    if quick:
        return Settings(learners=2, seconds=30, kill_every=10, restart_after=3, outer_kill_at=12, outer_restart_after=2,
                        model="tiny", inner_steps=5, batch_size=4, dp_checkpoint_s=4, device=device,
                        backlog_freeze_s=2.0, checkpoint_kill_at=19, checkpoint_window_s=8.0, step_seconds=0.02)
    return Settings(learners=8, seconds=300, kill_every=60, restart_after=20, outer_kill_at=150, outer_restart_after=5,
                    model="tiny", inner_steps=20, batch_size=8, dp_checkpoint_s=dp_checkpoint_s, device=device,
                    step_seconds=0.1)


@dataclass
class TargetedFault:
    """An outer-optimizer kill at a moment chosen by the state of the run, not the clock alone."""

    kind: str  # outer-backlog | outer-checkpoint
    at_s: float  # earliest moment, on the schedule's clock
    restart_after: float
    freeze_s: float = 0.0
    window_s: float = 0.0
    record: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------- targeted faults
def run_with_targeted(options, schedule: Schedule, targeted: list[TargetedFault]):
    """``ddiloco.chaos.run.run_with_chaos``, with ``targeted`` injected alongside the schedule
    through the same chaos controller (so they are logged, restarted and accounted like the rest)."""
    from ddiloco.chaos.run import run_with_chaos

    def inject(controller, backend, cluster, stop: threading.Event) -> None:
        _targeted_loop(controller, backend, cluster, options, targeted, stop)

    return run_with_chaos(options, schedule, alongside=inject)


def _outer_pending(address: str, security=None) -> int | None:
    from ddiloco.common.rpc import channel
    from ddiloco.v1 import outer_pb2, outer_pb2_grpc

    if not address:
        return None
    try:
        with channel(address, security, server_role="outer") as ch:
            return int(outer_pb2_grpc.OuterOptimizerStub(ch).GetStatus(outer_pb2.StatusRequest(), timeout=1).pending_deltas)
    except Exception:  # noqa: BLE001 - the outer may be frozen or restarting: no reading
        return None


def _checkpoint_tmp(out: pathlib.Path) -> bool:
    try:
        with os.scandir(out / "outer" / "checkpoints") as it:
            return any(e.name.startswith(".") and e.name.endswith(".tmp") for e in it)
    except OSError:
        return False


def _wait_checkpoint_start(out: pathlib.Path, window_s: float, stop: threading.Event) -> bool:
    """Block until a checkpoint's temporary folder appears (True) or ``window_s`` passes.

    A tiny model's checkpoint is written in about a millisecond, too short to catch by
    polling: inotify (Linux, through ctypes) wakes this thread as the folder is created.
    Elsewhere, or when inotify is unavailable, it polls every half millisecond."""
    import ctypes
    import select
    import struct

    folder = out / "outer" / "checkpoints"
    deadline = time.monotonic() + window_s
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
    except (OSError, AttributeError):
        fd = -1
    if fd < 0:
        while time.monotonic() < deadline and not stop.is_set():
            if _checkpoint_tmp(out):
                return True
            time.sleep(0.0005)
        return False
    try:
        IN_CREATE, IN_MOVED_TO = 0x100, 0x80
        if libc.inotify_add_watch(fd, str(folder).encode(), IN_CREATE | IN_MOVED_TO) < 0:
            os.close(fd)
            fd = -1
            return _wait_checkpoint_start_polling(out, deadline, stop)
        while time.monotonic() < deadline and not stop.is_set():
            ready, _, _ = select.select([fd], [], [], min(0.2, max(0.0, deadline - time.monotonic())))
            if not ready:
                continue
            try:
                buf = os.read(fd, 64 * 1024)
            except BlockingIOError:
                continue
            i = 0
            while i + 16 <= len(buf):
                _, _, _, length = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16:i + 16 + length].rstrip(b"\0").decode(errors="replace")
                i += 16 + length
                if name.startswith(".") and name.endswith(".tmp"):
                    return True
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def _wait_checkpoint_start_polling(out: pathlib.Path, deadline: float, stop: threading.Event) -> bool:
    while time.monotonic() < deadline and not stop.is_set():
        if _checkpoint_tmp(out):
            return True
        time.sleep(0.0005)
    return False


def _targeted_loop(controller, backend, cluster, options, faults: list[TargetedFault], stop: threading.Event) -> None:
    """Inject each targeted fault once its moment comes and its condition holds."""
    while controller.t0 is None:
        if stop.wait(0.25):
            return
    for f in sorted(faults, key=lambda x: x.at_s):
        rec = f.record
        rec.update({"kind": f.kind, "planned_at_s": f.at_s})
        if stop.wait(max(0.0, f.at_s - controller.now())):
            rec["skipped"] = "run ended first"
            return
        try:
            if backend.run_over():
                rec["skipped"] = "run was draining"
                continue
            if f.kind == "outer-backlog":
                address = cluster.registered_outer()
                fid = controller.inject("freeze", "outer")
                try:
                    stop.wait(f.freeze_s)
                finally:
                    controller.recover(fid)  # never left frozen
                deadline, best = time.monotonic() + 10.0, -1
                while time.monotonic() < deadline and not stop.is_set():
                    pending = _outer_pending(address, cluster.security)
                    if pending is not None:
                        best = max(best, pending)
                        if pending >= options.learners:
                            break
                    time.sleep(0.01)  # polling the outer's status
                rec["pending_seen_before_kill"] = best
                rec["backlog_condition_met"] = best >= options.learners
            else:
                pgid = backend.pid("outer")
                caught = _wait_checkpoint_start(options.out, f.window_s, stop)
                if caught:
                    # stopped at once, mid-write; the kill below (logged like every fault) follows
                    try:
                        os.killpg(pgid, signal.SIGSTOP)
                    except ProcessLookupError:
                        pass
                rec["checkpoint_tmp_seen"] = caught
            if stop.is_set():
                rec["skipped"] = "run ended first"
                return
            kid = controller.inject("kill", "outer")
            rec["kill_wall_t"] = round(time.time(), 3)
            rec["kill_at_s"] = round(controller.now(), 3)
            stop.wait(f.restart_after)
            controller.recover(kid)  # restarted even when the run ended meanwhile: it must finalize
        except Exception as exc:  # noqa: BLE001 - a fault that could not be placed is reported, never fatal
            rec["error"] = f"{type(exc).__name__}: {exc}"


def targeted_outcomes(faults: list[TargetedFault], events: list[dict], learners: int) -> list[dict]:
    """Per targeted fault: eval loss just before the kill, the worst after it, seconds until an
    evaluation is below the pre-kill loss again, and the evidence of what the kill hit."""
    evals = [(e["t"], float(e["eval_loss"])) for e in events if e["event"] == "eval" and "t" in e]
    kills = sorted(f.record["kill_wall_t"] for f in faults if f.record.get("kill_wall_t") is not None)
    out = []
    for f in faults:
        rec = dict(f.record)
        t_kill = rec.get("kill_wall_t")
        if t_kill is not None:
            # what the restart shows belongs to this kill only until the next one
            t_next = next((t for t in kills if t > t_kill), float("inf"))
            before = [l for t, l in evals if t < t_kill]
            after = [(t, l) for t, l in evals if t > t_kill]
            pre = before[-1] if before else None
            back = next((t for t, l in after if pre is not None and l < pre), None)
            window = [l for t, l in after if back is None or t <= back]
            rec["eval_loss_before"] = pre
            rec["eval_loss_worst_after"] = max(window) if window else None
            rec["seconds_to_below_pre_kill"] = round(back - t_kill, 2) if back is not None else None
            replay = next((e for e in events if e["event"] == "journal_replay" and t_kill < e.get("t", 0) < t_next), None)
            torn = next((e for e in events if e["event"] == "temporaries_removed" and t_kill < e.get("t", 0) < t_next), None)
            rec["journal_replayed_deltas"] = replay.get("deltas") if replay else 0
            rec["backlog_of_a_round_recovered"] = bool(replay) and replay.get("deltas", 0) >= learners
            rec["torn_checkpoint_removed"] = bool(torn)
        out.append(rec)
    return out


def time_to_loss(events: list[dict], level: float) -> float | None:
    """Seconds from the start of training (the chaos schedule's clock, else the first learner
    or dp rank start) to the first evaluation at or below ``level``."""
    starts = [e["t"] for e in events if e["event"] == "chaos_start"] or \
        [e["t"] for e in events if e["event"] in ("learner_start", "dp_start")]
    if not starts:
        return None
    t0 = min(starts)
    hit = cb.first_below([(e["t"] - t0, float(e["eval_loss"])) for e in events
                          if e["event"] in ("eval", "finalize") and "t" in e and e.get("eval_loss") is not None], level)
    return None if hit is None else round(max(0.0, hit), 2)


# ---------------------------------------------------------------------------------- ddiloco
def fault_plan(s: Settings, families: tuple[str, ...]) -> tuple[Schedule, list[TargetedFault]]:
    """The timed schedule and the targeted faults of the given fault ``families``."""
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown fault families {sorted(unknown)}; expected some of {FAMILIES}")
    return (s.schedule() if "learners" in families else Schedule([]),
            s.targeted() if "outer" in families else [])


def run_ddiloco(
    s: Settings, out: pathlib.Path, sync: bool, chaos: bool, families: tuple[str, ...] = FAMILIES, seed: int = 0
) -> dict:
    """One run; under ``chaos``, the schedule's fault ``families`` (both by default);
    ``seed``: the run's (the initial model's) seed."""
    from ddiloco.launcher.run import LaunchOptions

    flags = s.run_flags() + (["--sync", "--quorum", str(s.learners)] if sync else [])
    flags += ["--seed", str(seed)] if seed else []  # 0 is the run's default: the flags stay as they were
    schedule, targeted = fault_plan(s, families if chaos else ())
    t0 = time.monotonic()
    result = run_with_targeted(
        LaunchOptions(out=out, run_flags=flags, learners=s.learners, device=s.device, progress=False,
                      monitoring=False, timeout_s=s.seconds * 4 + 600, step_seconds=s.step_seconds),
        schedule,
        targeted,
    )
    if result.report is None:
        raise RuntimeError(f"run in {out} produced no report; failures {result.failures}; see {out}/logs")
    report = result.report
    audit = audit_run(out).summary()
    events = read_events(out / "metrics.jsonl")
    evals = [e for e in events if e["event"] == "eval"]
    injected = [e for e in events if e["event"] == "fault" and e["phase"] == "inject"]
    return {
        "method": "diloco-sync" if sync else "ddiloco",
        "faults": s.describe_faults(families) if chaos else "none",
        "goodput": report.get("goodput"),
        "final_eval_loss": round(report["final_eval_loss"], 4),
        "acked_deltas_lost": audit["acked_deltas_lost"],
        "deltas_applied_twice": audit["deltas_applied_twice"],
        "waste": report.get("waste"),
        "initial_eval_loss": round(evals[0]["eval_loss"], 4) if evals else None,
        "tokens_trained": report["tokens_trained"],
        "tokens_merged": report.get("tokens_merged"),
        "outer_steps": report["outer_steps"],
        "compute_per_step_s": compute_per_step(report),
        "versions_monotonic": audit["versions_monotonic"],
        "faults_injected": len(injected),
        "resume": resume_stats(events, s.inner_steps, s.batch_size * MODEL_PRESETS[s.model].context),
        "targeted_faults": targeted_outcomes(targeted, events, s.learners),
        "loss_curve": loss_curve(events),
        "fault_errors": result.fault_errors,
        "failures": result.failures,
        "notes": result.notes,
        "modelled": False,
        "wall_seconds": round(time.monotonic() - t0, 1),
        "run_dir": str(out),
    }


def compute_per_step(report: dict) -> float | None:
    """Mean seconds of compute per inner step over every learner (padding to the emulated
    step time included): at the floor when the emulation held, above it where this
    machine's contended cores made steps slower than the emulated hardware."""
    steps = sum(x["inner_steps"] for x in report.get("learners", []))
    return round(sum(x["compute_seconds"] for x in report["learners"]) / steps, 4) if steps else None


def loss_curve(events: list[dict]) -> list[tuple[int, float]]:
    """(tokens merged into the evaluated version, eval loss), in order."""
    tokens_at = {0: 0}
    for e in events:
        if e["event"] == "merge" and "tokens_merged" in e:
            tokens_at[e["version"]] = e["tokens_merged"]
    out = []
    for e in events:
        if e["event"] == "eval":
            known = [v for v in tokens_at if v <= e["version"]]
            out.append((tokens_at[max(known)], e["eval_loss"]))
    return out


def loss_at_tokens(curve: list[tuple[int, float]], tokens: float) -> float:
    """Eval loss at ``tokens`` merged, interpolated; the mean of the evaluations around it
    (within 5% of the tokens) damps the eval set's noise."""
    near = [l for t, l in curve if abs(t - tokens) <= 0.05 * tokens]
    if near:
        return sum(near) / len(near)
    return loss_at_step(curve, tokens)


def resume_stats(events: list[dict], inner_steps: int, tokens_per_step: int) -> dict:
    """Per learner restart: steps the dead incarnation trained whose deltas were neither
    acknowledged nor refused, which the new incarnation trains again (it resumes where the
    work answered for good ended: accepted, or refused as stale); steps of refused deltas
    (trained, dropped, not read again); steps skipped (must be 0)."""
    trained: dict[int, int] = {}
    refused: dict[int, int] = {}
    last_start: dict[int, dict] = {}
    retrained, refused_steps, skipped = [], 0, []
    for e in events:
        lid = e.get("learner")
        if e["event"] == "learner_start":
            if lid in last_start:
                advanced = e["batch_index"] - last_start[lid]["batch_index"]
                lost = trained.get(lid, 0) - advanced
                retrained.append(max(0, lost))
                skipped.append(max(0, -lost))
                refused_steps += refused.get(lid, 0)
            last_start[lid] = e
            trained[lid] = refused[lid] = 0
        elif e["event"] == "window" and lid in trained:
            trained[lid] += e["steps"]
        elif e["event"] == "upload_refused" and lid in refused:
            refused[lid] += e.get("tokens", 0) // tokens_per_step
    return {
        "restarts": len(retrained),
        "retrained_windows_max": round(max(retrained, default=0) / inner_steps, 2),
        "retrained_windows_mean": round(sum(retrained) / len(retrained) / inner_steps, 2) if retrained else 0.0,
        "refused_windows": round(refused_steps / inner_steps, 2),
        "skipped_steps": sum(skipped),
    }


# ---------------------------------------------------------------------------------- dp
def run_dp_fault_free(s: Settings, out: pathlib.Path) -> tuple[dict, dict]:
    from ddiloco.baselines.launch import launch_dp

    t_launch = time.time()
    report = launch_dp(out, s.learners, s.run_flags(), extra_flags=["--device", s.device, "--step-seconds", str(s.step_seconds)],
                       timeout_s=s.seconds * 4 + 600)
    events = read_events(out / "metrics.jsonl")
    starts = [e["t"] for e in events if e["event"] == "dp_start"]
    # start-up: launch to the moment the last rank is ready to train
    startup = (max(starts) - t_launch) if starts else 0.0
    evals = [(e["version"], e["eval_loss"]) for e in events if e["event"] == "eval"]
    provisioned = s.learners * (report["wall_seconds"] + startup)
    measured = {
        "startup_s": round(startup, 2),
        "steps": report["optimizer_steps"],
        "wall_s": report["wall_seconds"],
        "compute_share": report["compute_seconds"] / (s.learners * report["wall_seconds"]),
        "evals": evals,
    }
    row = {
        "method": "dp",
        "faults": "none",
        "goodput": round(report["compute_seconds"] / provisioned, 4),
        "final_eval_loss": round(report["final_eval_loss"], 4),
        "acked_deltas_lost": None,
        "deltas_applied_twice": None,
        "waste": None,
        "initial_eval_loss": round(report["initial_eval_loss"], 4),
        "tokens_trained": report["tokens_trained"],
        "compute_per_step_s": round(report["compute_seconds"] / (s.learners * report["optimizer_steps"]), 4)
        if report["optimizer_steps"] else None,
        "modelled": False,
        "run_dir": str(out),
    }
    return row, measured


def loss_at_step(evals: list[tuple[int, float]], step: float) -> float:
    evals = sorted(evals)
    if step <= evals[0][0]:
        return evals[0][1]
    for (s0, l0), (s1, l1) in zip(evals, evals[1:]):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / max(s1 - s0, 1)
    return evals[-1][1]


def model_dp_under_faults(s: Settings, measured: dict) -> dict:
    """DP under the learner-kill schedule, from its measured fault-free run (see module doc)."""
    kills = [f.at_s for f in s.schedule().faults if f.target == "learner"]
    budget = s.seconds + measured["startup_s"]  # the same span ddiloco's slots are provisioned
    productive = s.seconds  # training seconds of the fault-free run
    for _ in kills:
        productive -= s.dp_checkpoint_s / 2 + s.restart_after + measured["startup_s"]
    productive = max(0.0, productive)
    steps_per_s = measured["steps"] / measured["wall_s"]
    step = steps_per_s * productive
    return {
        "method": "dp",
        "faults": f"{s.describe_faults()} (modelled; outer kill n/a)",
        "goodput": round(measured["compute_share"] * productive / budget, 4),
        "final_eval_loss": round(loss_at_step(measured["evals"], step), 4),
        "acked_deltas_lost": None,
        "deltas_applied_twice": None,
        "waste": None,
        "modelled": True,
        "model": {
            "checkpoint_every_s": s.dp_checkpoint_s,
            "lost_per_kill_s": s.dp_checkpoint_s / 2,
            "down_per_kill_s": s.restart_after + measured["startup_s"],
            "kills": len(kills),
            "productive_s": round(productive, 2),
            "steps": round(step),
            "compute_share": round(measured["compute_share"], 4),
        },
    }


# ---------------------------------------------------------------------------------- main
def fmt(x, spec=".3f") -> str:
    if x is None:
        return "n/a"
    return format(x, spec) if isinstance(x, float) else str(x)


def print_table(rows: list[dict]) -> None:
    print("\n| method | faults | goodput | tokens trained | s per step | final eval loss | acked deltas lost | "
          "deltas applied twice | s to diloco-sync's final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        faults = "none" if r["faults"] == "none" else ("schedule, modelled" if r.get("modelled") else "schedule")
        reach = r.get("time_to_sync_final_s")
        reach_s = "n/a (modelled)" if r.get("modelled") else ("never" if reach is None else f"{reach:.0f}")
        tokens = "n/a" if r.get("tokens_trained") is None else f"{r['tokens_trained']:,}"
        print(
            f"| {r['method']} | {faults} | {fmt(r['goodput'])} | {tokens} | "
            f"{fmt(r.get('compute_per_step_s'), '.4f')} | {fmt(r['final_eval_loss'], '.4f')} | "
            f"{fmt(r['acked_deltas_lost'])} | {fmt(r['deltas_applied_twice'])} | {reach_s} |"
        )


def print_targeted(rows: list[dict]) -> None:
    items = [(r["method"], t) for r in rows for t in r.get("targeted_faults") or []]
    if not items:
        return
    print("\n| method | outer kill | at s | condition met | loss before | worst after | s to below pre-kill | "
          "replayed deltas | torn checkpoint removed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, t in items:
        cond = t.get("backlog_condition_met", t.get("checkpoint_tmp_seen"))
        if t.get("skipped") or t.get("error"):
            print(f"| {method} | {t['kind']} | - | {t.get('skipped') or t.get('error')} | | | | | |")
            continue
        back = t.get("seconds_to_below_pre_kill")
        print(f"| {method} | {t['kind']} | {fmt(t.get('kill_at_s'), '.1f')} | {fmt(cond)} | "
              f"{fmt(t.get('eval_loss_before'), '.4f')} | {fmt(t.get('eval_loss_worst_after'), '.4f')} | "
              f"{'never' if back is None else f'{back:.1f}'} | {fmt(t.get('journal_replayed_deltas'))} | "
              f"{fmt(t.get('torn_checkpoint_removed'))} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 learners, 30 s, faults every 10 s")
    ap.add_argument("--learners", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--dp-checkpoint-s", type=float, default=30.0, help="DP model: seconds between its (free) checkpoints")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="run folders (default: /tmp/ddiloco-bench-chaos-<time>)")
    ap.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    ap.add_argument("--step-seconds", type=float, default=None, metavar="T",
                    help="emulated dedicated hardware: every step at least T seconds (default 0.1 full, 0.02 quick; 0: off)")
    ap.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    args = ap.parse_args(argv)
    s = bench_settings(args.quick, args.device, args.dp_checkpoint_s)
    if args.step_seconds is not None:
        s.step_seconds = args.step_seconds
    if args.learners:
        s.learners = args.learners
    if args.seconds:
        s.seconds = args.seconds
        s.outer_kill_at = s.seconds / 2
        s.checkpoint_kill_at = -1.0  # 0.7 x seconds
    prov = cb.start_provenance(args.allow_dirty or args.quick, "chaos")
    out = args.out or pathlib.Path(f"/tmp/ddiloco-bench-chaos-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"chaos bench: M={s.learners}, T={s.seconds:g}s, model {s.model}, step >= {s.step_seconds:g}s; "
          f"faults: {s.describe_faults()}", file=sys.stderr)

    rows = []
    for name, sync, chaos in (("ddiloco-clean", False, False), ("ddiloco-chaos", False, True), ("sync-chaos", True, True)):
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
        rows.append(run_ddiloco(s, out / name, sync=sync, chaos=chaos))
    print(f"[{time.strftime('%H:%M:%S')}] dp (fault-free, measured) ...", file=sys.stderr, flush=True)
    dp_clean, measured = run_dp_fault_free(s, out / "dp-clean")
    rows.append(model_dp_under_faults(s, measured))
    rows.append(dp_clean)

    clean, chaos_row = rows[0], rows[1]
    gap = chaos_row["final_eval_loss"] / clean["final_eval_loss"] - 1
    # the same comparison at equal work merged: on a shared machine the time budget buys
    # different amounts of compute from run to run
    equal = min(clean["tokens_merged"], chaos_row["tokens_merged"])
    gap_tokens = loss_at_tokens(chaos_row["loss_curve"], equal) / loss_at_tokens(clean["loss_curve"], equal) - 1
    # issue 17 item 6: when each method first reaches diloco-sync's final loss under the schedule
    sync_row = rows[2]
    level = sync_row["final_eval_loss"]
    # the rows' losses are rounded to 4 decimals, the eval events to 5: half a unit of the
    # 4th decimal of slack, so that diloco-sync's own final evaluation counts as reaching it
    for r in rows:
        r["time_to_sync_final_s"] = None if r.get("modelled") else time_to_loss(
            read_events(pathlib.Path(r["run_dir"]) / "metrics.jsonl"), level + 5e-5)
    reach_dd, reach_sync = chaos_row["time_to_sync_final_s"], sync_row["time_to_sync_final_s"]
    checks = {
        "sync_final_loss_under_chaos": level,
        "ddiloco_reaches_sync_final_first": reach_dd is not None and (reach_sync is None or reach_dd < reach_sync),
        "ddiloco_seconds_to_sync_final": reach_dd,
        "sync_seconds_to_sync_final": reach_sync,
        "ddiloco_final_le_sync_final_under_chaos": chaos_row["final_eval_loss"] <= level,
        "ddiloco_goodput_under_chaos": chaos_row["goodput"],
        "goodput_target": TARGETS["goodput"],
        "goodput_met": chaos_row["goodput"] is not None and chaos_row["goodput"] >= TARGETS["goodput"],
        "loss_gap_vs_fault_free": round(gap, 4),
        "loss_gap_target": TARGETS["loss_gap"],
        "loss_gap_met": gap <= TARGETS["loss_gap"],
        "equal_tokens_merged": equal,
        "loss_gap_at_equal_tokens_merged": round(gap_tokens, 4),
        "acked_deltas_lost_zero": all(r["acked_deltas_lost"] == 0 for r in rows[:3]),
        "deltas_applied_twice_zero": all(r["deltas_applied_twice"] == 0 for r in rows[:3]),
        "versions_monotonic": all(r["versions_monotonic"] for r in rows[:3]),
        # the emulation held where every measured row's mean step is within 10% of the floor
        # (a contended core makes a step slower than the emulated hardware; never faster)
        "step_seconds": s.step_seconds,
        "emulated_step_held": s.step_seconds > 0 and all(
            r["compute_per_step_s"] is not None and r["compute_per_step_s"] <= 1.1 * s.step_seconds
            for r in rows if not r.get("modelled")),
    }
    doc = {
        "command": "python bench/chaos.py" + (" --quick" if args.quick else ""),
        "git_rev": prov["git_rev"],
        "host": f"{platform.node()} ({platform.machine()}, {platform.processor() or 'cpu'})",
        "settings": vars(s),
        "provenance": cb.finish_provenance(prov),
        "checks": checks,
        "rows": rows,
        "argv": shlex.join(sys.argv),
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / ("chaos-quick.json" if args.quick else "chaos.json")
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print_table(rows)
    print_targeted(rows)
    print(f"\nddiloco under chaos: goodput {fmt(chaos_row['goodput'])} (target >= {TARGETS['goodput']}), "
          f"final loss {gap:+.2%} vs fault-free (target <= +{TARGETS['loss_gap']:.0%}); "
          f"at equal tokens merged ({equal:,}): {gap_tokens:+.2%}")
    print(f"diloco-sync's final loss under chaos {level:.4f}: ddiloco reaches it at "
          f"{'never' if reach_dd is None else f'{reach_dd:.0f}s'}, diloco-sync at "
          f"{'never' if reach_sync is None else f'{reach_sync:.0f}s'}")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
