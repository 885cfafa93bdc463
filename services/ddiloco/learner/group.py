"""A learner that is a torch.distributed group: R ranks, data-parallel inside one datacenter.

In the paper each learner is a datacenter's worth of accelerators running ordinary
data-parallel training; only the learners talk over the WAN. Here the learner process is
rank 0 of a group of R (``ddiloco learner --nproc-per-learner R``); it starts ranks 1..R-1
as child processes (``ddiloco.learner.rank``) on this host, rendezvous on the loopback
interface (never across the WAN), gloo on CPU, NCCL on GPU.

Rank 0 alone speaks gRPC: it registers, pulls, folds and uploads exactly as a one-process
learner does. The other ranks hold the same replica: every step, rank 0 broadcasts a small
control tensor (stop, and which fragments to re-send), then the parameters of the fragments
it folded a new global version into (or ended a window of: a re-send there bounds any drift
between replicas to one window); every rank trains on its own batch, gradients are averaged
over the group (an all-reduce, as DistributedDataParallel does; done by hand so that any
workload's module works unwrapped) and every rank takes the same AdamW step.

Data: the group consumes R consecutive batches of the learner's shard per step, rank r the
r-th, so a group step weighs the sum of its R batches and resumption (a count of whole
batches) stays exact.

Faults: a rank that dies fails the next collective on every other rank, so rank 0 fails and
exits non-zero, taking its children down (and they watch their parent too): the learner
fails as a unit and, restarted, resumes like any other.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ddiloco.learner.inner_state import load_moments

log = logging.getLogger(__name__)

# collectives wait this long for a peer: rank 0 may block between steps (a synchronous
# learner waiting for its merge, an outer optimizer down) for as long as the run allows
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)
# every rank checks in within this long of being started (a cold start imports torch and may
# initialize a device: seconds, a minute on a loaded host), or the learner fails
JOIN_TIMEOUT_S = 300.0


def strided(batches: Iterator[Any], every: int) -> Iterator[Any]:
    """Every ``every``-th batch of ``batches`` from the first: rank r of R reads batches
    start + r, start + r + R, ... of its learner's shard."""
    while True:
        batch = next(batches)
        yield batch
        for _ in range(every - 1):
            next(batches)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def local_only(backend: str) -> None:
    """Gloo picks its interface from the host name, which may resolve to an address of the
    WAN side; the group's traffic stays on the loopback interface instead."""
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



# Most bytes of a set-up message: the run configuration as JSON is a few kB.
MAX_SETUP_BYTES = 1 << 20


def broadcast_json(obj: Any, device: torch.device) -> Any:
    """Rank 0's ``obj`` on every rank, as JSON in a byte tensor: torch's
    ``broadcast_object_list`` would unpickle what another process sends."""
    if dist.get_rank() == 0:
        data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    n = int(size.item())
    if not 0 < n <= MAX_SETUP_BYTES:
        raise ValueError(f"learner group set-up of {n} bytes (at most {MAX_SETUP_BYTES})")
    if dist.get_rank() != 0:
        data = torch.empty(n, dtype=torch.uint8)
    data = data.to(device)
    dist.broadcast(data, src=0)
    return json.loads(bytes(data.cpu().tolist()).decode())


class Solo:
    """A learner of one process: every group operation is nothing."""

    size = 1

    def share_setup(self, setup: dict, params: list[torch.Tensor], fragments: list[list[int]],
                    optimizer: torch.optim.Optimizer | None = None) -> None:
        pass

    def before_step(self, resend: set[int]) -> None:
        pass

    def average(self, params: list[torch.Tensor], loss: float, weight: int) -> tuple[float, int]:
        return loss, weight

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass


class GroupFailed(RuntimeError):
    """The group did not form: a rank exited first, or it did not join in time."""


class Group:
    """Rank 0's side of a learner group of ``size`` ranks.

    The other ranks run in a session of their own, so that a signal meant for the learner
    (the launcher's SIGTERM to the learner's process group, a Ctrl-C in its terminal) reaches
    rank 0 alone: rank 0 drains, flushes its windows and stops the others with its stop
    message. Before, the signal killed the other ranks at once, rank 0's next collective failed,
    and every interrupted run reported its grouped learners as failed, their last windows
    unsent. A rank still ends with its learner: it watches rank 0, its parent, by pid.

    Forming the group waits for every rank to check in (a key in the rendezvous store),
    watching the children and ``stop`` meanwhile: a rank that exits before it joins
    (out of memory, a device error at start) fails the learner at once, with its exit code,
    where the rendezvous alone waited the whole collective timeout (two hours) while the
    learner's heartbeats said it was alive."""

    def __init__(self, size: int, device: torch.device, threads: int, stop: threading.Event | None = None,
                 join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        self.size = size
        self.device = device
        self.backend = backend_for(device)
        local_only(self.backend)
        port = free_port()
        init = f"tcp://127.0.0.1:{port}"
        store = dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                              wait_for_workers=False)
        self.children = [
            subprocess.Popen([sys.executable, "-m", "ddiloco.learner.rank", "--rank", str(r), "--world", str(size),
                              "--init", init, "--device", device.type, "--threads", str(threads),
                              "--parent", str(os.getpid())],
                             start_new_session=True)
            for r in range(1, size)
        ]
        try:
            self._wait_for_ranks(store, stop, join_timeout_s)
            dist.init_process_group(self.backend, store=store, rank=0, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            for child in self.children:
                child.kill()
                child.wait()
            raise
        self.stopped = False
        log.info("learner group of %d ranks (%s) formed on 127.0.0.1:%d", size, self.backend, port)

    def _wait_for_ranks(self, store, stop: threading.Event | None, join_timeout_s: float) -> None:
        keys = [joined_key(r) for r in range(1, self.size)]
        deadline = time.monotonic() + join_timeout_s
        while not store.check(keys):
            # (store.wait with a short timeout logs a warning at every timeout)
            if stop is not None:
                stop.wait(0.2)
            else:
                time.sleep(0.2)
            for r, child in enumerate(self.children, start=1):
                code = child.poll()
                if code is not None:
                    raise GroupFailed(f"rank {r} of the learner group exited with code {code} before the group formed")
            if stop is not None and stop.is_set():
                raise InterruptedError("stopped while the learner group formed")
            if time.monotonic() > deadline:
                raise GroupFailed(f"the learner group's ranks did not all join within {join_timeout_s:.0f} s")
        log.info("every rank of the learner group checked in")

    def share_setup(self, setup: dict, params: list[torch.Tensor], fragments: list[list[int]],
                    optimizer: torch.optim.Optimizer | None = None) -> None:
        """Tell the other ranks what to build and where to read, then give them the replica,
        and the AdamW moments rank 0 restored (``setup["adam_step"]`` > 0, learner/inner_state.py).
        ``fragments``: the partition (each rank derives the same one from the model)."""
        self.params, self.fragments = params, fragments
        broadcast_json(setup, self.device)
        for p in params:
            dist.broadcast(p.data, src=0)
        if setup.get("adam_step", 0) > 0:
            share_moments(optimizer, params, setup["adam_step"])

    def before_step(self, resend: set[int]) -> None:
        """Start a step on every rank, re-sending the fragments in ``resend`` (rank 0 folded
        a new global version into them, or ended one of their windows)."""
        control = [0] + [int(f in resend) for f in range(len(self.fragments))]
        dist.broadcast(torch.tensor(control, dtype=torch.int64, device=self.device), src=0)
        receive_or_send(self.params, self.fragments, control)

    def average(self, params: list[torch.Tensor], loss: float, weight: int) -> tuple[float, int]:
        return average_gradients(params, loss, weight, self.size, self.device)

    def stop(self) -> None:
        """The run drains: the other ranks leave their loop and exit."""
        if not self.stopped:
            control = [1] + [0] * len(self.fragments)
            dist.broadcast(torch.tensor(control, dtype=torch.int64, device=self.device), src=0)
            self.stopped = True

    def close(self) -> None:
        if self.stopped:
            for child in self.children:
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    child.kill()
            dist.destroy_process_group()
        else:  # rank 0 failed: the group goes down with it
            for child in self.children:
                child.kill()
                child.wait()


def share_moments(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], adam_step: int) -> None:
    """Rank 0's AdamW moments on every rank (an optimizer with no state yet, on the others).
    Every rank steps on the group's mean gradient, so the ranks' moments are equal from then on,
    as they were before the restart."""
    rank0 = dist.get_rank() == 0
    # which parameters rank 0's AdamW holds state for (not one never given a gradient)
    held = torch.tensor([bool(optimizer.state.get(p)) if rank0 else False for p in params], dtype=torch.int64,
                        device=params[0].device if params else "cpu")
    dist.broadcast(held, src=0)
    moments: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for p, has in zip(params, held.tolist()):
        if not has:
            moments.append(None)
            continue
        if rank0:
            pair = (optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
        else:
            pair = (torch.zeros_like(p), torch.zeros_like(p))
        for t in pair:
            dist.broadcast(t, src=0)
        moments.append(pair)
    if not rank0:
        load_moments(optimizer, moments, adam_step)


def receive_or_send(params: list[torch.Tensor], fragments: list[list[int]], control: list[int]) -> None:
    """The tensors of every fragment flagged in ``control[1:]``, from rank 0 to the others."""
    for f, flagged in enumerate(control[1:]):
        if flagged:
            for i in fragments[f]:
                dist.broadcast(params[i].data, src=0)


def average_gradients(params: list[torch.Tensor], loss: float, weight: int, size: int, device) -> tuple[float, int]:
    """Gradients averaged over the group (a parameter without a gradient on one rank counts
    as zero there); returns the group's mean loss and summed batch weight."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(size)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n
    # float64: weights are integers, exact up to 2^53
    totals = torch.tensor([loss, float(weight)], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return float(totals[0]) / size, int(totals[1])


def joined_key(rank: int) -> str:
    """The rendezvous store's key a rank sets once it is up, before it joins the group."""
    return f"ddiloco/joined/{rank}"


def watch_parent(parent: int) -> None:
    """End this process when ``parent``, the learner that started it, is gone (a rank never
    outlives its learner, even when the learner was killed between two collectives). The
    pid comes from the learner itself: one read here, after the seconds this process takes
    to start, would be init's if the learner had died meanwhile, and would never change."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
