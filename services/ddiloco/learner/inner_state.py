"""A learner's inner-optimizer state on its own disk, so that a restarted learner goes on
where it was instead of starting its optimizer afresh.

What a learner's process takes with it when it dies: not the parameters (the outer
optimizer holds the global ones, and the window in flight is trained again from its
acknowledged work, ``worker.py``), but its AdamW moments and its place in the learning-rate
schedule. Restarted without them it warms its rate up again from step 0 and rebuilds its
moments from a handful of gradients, which cost the learner kills of the chaos bench
per token (docs/chaos.md). A datacenter's learner has a disk of its own; this keeps them
there.

Kept, per learner id, in one safetensors file (no pickle: nothing here can run code from
the file): each parameter's ``exp_avg`` and ``exp_avg_sq``, and a JSON header with the run
id, the learner id, the model's signature (names and shapes), Adam's step count and the
learner's schedule step (how far into its warm-up it is). Snapshot every H inner steps and
written on a thread of its own (``Keeper``), atomically (``common/durable.py``): a crash
leaves the previous file or the new one.

Read back only if it is this run's, this learner's and this model's, and holds what AdamW
can hold (finite moments, second moments >= 0, counts in range); otherwise it is ignored
with the reason logged and the learner starts afresh, as it did before this file existed.
It never stops a learner from starting.
"""

from __future__ import annotations

import json
import logging
import pathlib
import threading
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ddiloco.common import durable

log = logging.getLogger("ddiloco.learner.inner_state")

FORMAT = 1
# a learner's step count is bounded by its run's token budget, far below this; a larger
# count in the file is not one this run wrote
MAX_STEPS = 1 << 40


class StaleState(ValueError):
    """The file is not this learner's state in this run, or is not a state AdamW can hold."""


@dataclass(frozen=True)
class Restored:
    adam_step: int  # AdamW's own step count (bias correction)
    schedule_step: int  # the learner's steps so far, for its learning-rate schedule
    without_state: tuple[int, ...] = ()  # parameters AdamW holds nothing for (never a gradient)


def path_for(folder: pathlib.Path, learner_id: int) -> pathlib.Path:
    return pathlib.Path(folder) / f"learner-{learner_id}.safetensors"


def _signature(names: list[str], params: list[torch.Tensor]) -> list[list]:
    return [[n, list(p.shape)] for n, p in zip(names, params)]


@dataclass(frozen=True)
class Snapshot:
    tensors: dict[str, torch.Tensor]  # copies, on the CPU
    meta: dict[str, str]


def snapshot(run_id: str, learner_id: int, names: list[str], params: list[torch.Tensor],
             optimizer: torch.optim.Optimizer, schedule_step: int, run_instance: str = "") -> Snapshot | None:
    """A copy of the state as it is now (None before AdamW's first step: nothing to keep).
    A parameter AdamW holds nothing for (frozen, or on a path no batch has taken) is listed
    in the header as such: a workload with one must not go without its state for good."""
    tensors: dict[str, torch.Tensor] = {}
    steps = set()
    without = []
    for i, p in enumerate(params):
        st = optimizer.state.get(p)
        if not st:
            without.append(i)
            continue
        # copies: the optimizer goes on updating its own in place while the file is written
        tensors[f"{i}.exp_avg"] = st["exp_avg"].detach().to("cpu", torch.float32, copy=True).contiguous()
        tensors[f"{i}.exp_avg_sq"] = st["exp_avg_sq"].detach().to("cpu", torch.float32, copy=True).contiguous()
        steps.add(int(st["step"]))
    if not steps:
        return None
    meta = {
        "format": str(FORMAT),
        "run_id": run_id,
        "run_instance": run_instance,
        "learner_id": str(learner_id),
        "adam_step": str(max(steps)),
        "schedule_step": str(schedule_step),
        "model": json.dumps(_signature(names, params)),
        "without_state": json.dumps(without),
    }
    return Snapshot(tensors, meta)


def write(path: pathlib.Path, snap: Snapshot) -> None:
    """Replace the file atomically. Raises ``durable.StorageError`` if the disk refuses it."""
    path = pathlib.Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise durable.StorageError(path, exc) from exc
    durable.write_bytes(path, save_tensors(snap.tensors, metadata=snap.meta))


def save(path: pathlib.Path, run_id: str, learner_id: int, names: list[str], params: list[torch.Tensor],
         optimizer: torch.optim.Optimizer, schedule_step: int, run_instance: str = "") -> bool:
    """Snapshot and write at once (False, and nothing written, before AdamW's first step)."""
    snap = snapshot(run_id, learner_id, names, params, optimizer, schedule_step, run_instance)
    if snap is None:
        return False
    write(path, snap)
    return True


class Keeper:
    """Writes the state on a thread of its own, so that training does not wait for the disk.

    The training thread only copies the moments (``offer``: a memory copy of two tensors per
    parameter) and goes on; serializing and the fsync'd write (65-110 ms for the default
    model's 15 MB here, 2-3% of a window of its training if done in line) happen here. A
    snapshot offered while another is being written replaces the one waiting, if any: the
    file is never more than one snapshot behind, and memory holds at most two. A disk that
    refuses a write costs the next restart its warm start, not the learner its training:
    ``on_unsaved`` is told, and the next snapshot tries again. Anything else that goes wrong
    here fails the learner loudly (the thread runs under its supervisor)."""

    def __init__(self, path: pathlib.Path, on_unsaved) -> None:
        self.path = pathlib.Path(path)
        self.on_unsaved = on_unsaved
        self.written = 0
        self.abandoned = False  # the file is another process's now: nothing more is written
        self._pending: Snapshot | None = None
        self._cond = threading.Condition()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def offer(self, snap: Snapshot | None) -> None:
        if snap is None:
            return
        with self._cond:
            if self.abandoned:
                return
            self._pending = snap
            self._cond.notify()

    def loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self.stopping.is_set():
                    self._cond.wait()
                snap, self._pending = self._pending, None
            if snap is None or self.abandoned:
                return  # stopping, and nothing left to write (or nothing more of ours to write)
            try:
                write(self.path, snap)
                self.written += 1
            except durable.StorageError as exc:
                log.warning("inner state not saved (training goes on; a restart would start its optimizer afresh): %s",
                            exc)
                self.on_unsaved(exc)

    def abandon(self) -> None:
        """This process lost its learner id to a successor, which restored from this file and
        now keeps it: drop what waits and write nothing more (a write already under way ends
        as one atomic replace, which the successor's next snapshot replaces in turn). Else
        the old process's last snapshot, written as it stops, replaced its successor's, and
        a successor restarted after that took back moments of work that was never merged."""
        with self._cond:
            self.abandoned = True
            self._pending = None
            self._cond.notify()

    def start(self, supervisor) -> None:
        self.thread = supervisor.spawn("inner-state", self.loop, self.stopping)

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is waiting, then end the thread."""
        with self._cond:
            self.stopping.set()
            self._cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)


def _read(path: pathlib.Path, max_bytes: int = 1 << 62) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """``max_bytes``: what the file of this model can hold (``restore``); a larger one, or
    one that is no regular file, raises ``durable.FileRefused`` (an OSError) unread."""
    data = durable.read_file(path, max_bytes)
    try:
        tensors = load_tensors(data)
        # the header is JSON of its own length at the file's start (the safetensors format)
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except (SafetensorError, ValueError, json.JSONDecodeError) as exc:
        raise StaleState(f"not a safetensors file ({exc})") from None
    return meta, tensors


def _int(meta: dict[str, str], key: str, low: int, high: int) -> int:
    try:
        value = int(meta[key])
    except (KeyError, ValueError):
        raise StaleState(f"its header has no whole number {key!r}") from None
    if not low <= value <= high:
        raise StaleState(f"its {key} {value} is outside [{low}, {high}]")
    return value


def first_moment_bound(betas: tuple[float, float]) -> float | None:
    """C such that every |exp_avg| <= C sqrt(exp_avg_sq), whatever the gradients: with
    m = (1-b1) sum b1^k g_k and v = (1-b2) sum b2^k g_k^2, Cauchy-Schwarz on
    b1^k g_k = (b1^k / b2^(k/2)) (b2^(k/2) g_k) gives |m| <= (1-b1) sqrt(S v / (1-b2)), with
    S = sum (b1^2/b2)^k = 1 / (1 - b1^2/b2). It bounds AdamW's step m / sqrt(v) (1.165 at
    betas (0.9, 0.95)); None where b1^2 >= b2 (no bound)."""
    b1, b2 = betas
    if not (0 <= b1 < 1 and 0 <= b2 < 1 and b1 * b1 < b2):
        return None
    return (1 - b1) / ((1 - b2) * (1 - b1 * b1 / b2)) ** 0.5


# float32 rounding of both moments, and a gradient so small its square underflows to 0 in v
# (|g| < 4e-23) while m keeps it: far below any step AdamW could take (eps is 1e-8)
_BOUND_RTOL, _BOUND_ATOL = 1e-3, 1e-12


def check(meta: dict[str, str], tensors: dict[str, torch.Tensor], run_id: str, learner_id: int,
          names: list[str], params: list[torch.Tensor], betas: tuple[float, float] = (0.9, 0.999),
          run_instance: str = "") -> Restored:
    """Whether the file's contents are this learner's state in this run, for this model, and
    a state AdamW of ``betas`` can hold (``first_moment_bound``). Raises ``StaleState``
    saying why not. ``run_instance``: the coordinator's token of this run (empty: unknown,
    or a file written before it: the run id decides)."""
    if meta.get("format") != str(FORMAT):
        raise StaleState(f"format {meta.get('format')!r}, this version writes {FORMAT}")
    if meta.get("run_id") != run_id:
        raise StaleState(f"it is run {meta.get('run_id')!r}'s, this run is {run_id!r}")
    if run_instance and meta.get("run_instance") and meta["run_instance"] != run_instance:
        # the same run id, another run: its moments and warm-up place would start this run's
        # optimizer past its warm-up, on moments of another model's history
        raise StaleState(f"it is an earlier run's of the same id {run_id!r} (run instance {meta['run_instance'][:32]!r}, "
                         f"this run is {run_instance!r})")
    if meta.get("learner_id") != str(learner_id):
        raise StaleState(f"it is learner {meta.get('learner_id')}'s, this is learner {learner_id}")
    if meta.get("model") != json.dumps(_signature(names, params)):
        raise StaleState("its model (names and shapes) is not this run's")
    adam_step = _int(meta, "adam_step", 1, MAX_STEPS)
    schedule_step = _int(meta, "schedule_step", 0, MAX_STEPS)
    try:  # absent: a file written before parameters without state were listed (none were)
        without = json.loads(meta.get("without_state", "[]"))
    except json.JSONDecodeError:
        without = None
    if not (isinstance(without, list) and all(type(i) is int for i in without)
            and without == sorted(set(without)) and all(0 <= i < len(params) for i in without)
            and len(without) < len(params)):
        raise StaleState("its list of parameters without state is not one of this model's")
    absent = set(without)
    held = [i for i in range(len(params)) if i not in absent]
    expected = {f"{i}.{k}" for i in held for k in ("exp_avg", "exp_avg_sq")}
    if set(tensors) != expected:
        raise StaleState(f"it holds {len(tensors)} tensors, not the {len(expected)} of this model's moments")
    for i in held:
        p = params[i]
        for k in ("exp_avg", "exp_avg_sq"):
            t = tensors[f"{i}.{k}"]
            if t.dtype != torch.float32 or tuple(t.shape) != tuple(p.shape):
                raise StaleState(f"{names[i]}'s {k} is {t.dtype} {tuple(t.shape)}, not float32 {tuple(p.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise StaleState(f"{names[i]}'s {k} holds NaN or Inf")
        if bool((tensors[f"{i}.exp_avg_sq"] < 0).any()):
            raise StaleState(f"{names[i]}'s exp_avg_sq holds negative values")
    bound = first_moment_bound(betas)
    for i in held if bound is not None else ():
        # finite moments that break the bound (exp_avg 1e20) are none AdamW can reach: its
        # first step would throw the parameters to 1e19 and fail the learner, at every restart
        m, v = tensors[f"{i}.exp_avg"].double(), tensors[f"{i}.exp_avg_sq"].double()
        excess = m.abs() - (bound * v.sqrt() * (1 + _BOUND_RTOL) + _BOUND_ATOL)
        if bool((excess > 0).any()):
            ratio = float((m.abs() / v.sqrt().clamp_min(1e-300)).max())
            raise StaleState(
                f"{names[i]}'s exp_avg reaches {ratio:.3g} x sqrt(exp_avg_sq), beyond the {bound:.3g} AdamW with "
                f"betas {tuple(betas)} can reach"
            )
    return Restored(adam_step, schedule_step, tuple(without))


def restore(path: pathlib.Path, run_id: str, learner_id: int, names: list[str], params: list[torch.Tensor],
            optimizer: torch.optim.Optimizer, run_instance: str = "") -> Restored | None:
    """Load the state into ``optimizer`` (an AdamW over ``params`` with no state yet) if the
    file is there and is this learner's; else None, with the reason logged."""
    path = pathlib.Path(path)
    if not path.exists():
        return None
    try:
        # two float32 moments per parameter value, and a header of names and shapes
        meta, tensors = _read(path, 8 * sum(p.numel() for p in params) + (1 << 20) + 64 * len(params))
        betas = tuple(optimizer.param_groups[0].get("betas", (0.9, 0.999)))
        restored = check(meta, tensors, run_id, learner_id, names, params, betas, run_instance)
    except (StaleState, OSError) as exc:
        log.warning("inner state %s not restored, starting afresh: %s", path, exc)
        return None
    moments = [
        None if i in restored.without_state else (tensors[f"{i}.exp_avg"], tensors[f"{i}.exp_avg_sq"])
        for i in range(len(params))
    ]
    load_moments(optimizer, moments, restored.adam_step)
    return restored


def load_moments(optimizer: torch.optim.Optimizer, moments: list[tuple[torch.Tensor, torch.Tensor] | None],
                 adam_step: int) -> None:
    """Give an AdamW (no state yet) each parameter's (exp_avg, exp_avg_sq), in parameter
    order, and Adam's step count; ``load_state_dict`` moves them to each parameter's device.
    None: a parameter AdamW held nothing for, left so (its first gradient starts its state)."""
    state = optimizer.state_dict()
    for i, pair in enumerate(moments):
        if pair is None:
            continue
        exp_avg, exp_avg_sq = pair
        state["state"][i] = {"step": torch.tensor(float(adam_step)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    optimizer.load_state_dict(state)
