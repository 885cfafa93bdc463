"""Synchronous data-parallel training: one rank of W, all-reducing gradients every step.

Everything a ddiloco learner does the same way is done the same way here, through the run's
workload (``ddiloco.workloads``): the model (``model()`` under the run's seed, so every rank
starts from identical weights), the data (``train_batches`` of shard r of W for rank r,
seeded like learner r), the loss, the inner optimizer (AdamW, betas (0.9, 0.95), the run's
weight decay, linear warmup, gradient clipping) and the evaluation (the workload's held-out
batches). Tokens are counted as the run's step weight per rank step (``reference_weight``:
``batch x context`` for the built-in model). The only difference is the one being measured: gradients are averaged
over the W ranks before every optimizer step, so the W replicas never drift apart; the
global batch is W times the per-learner batch, at the same learning rate.

One all-reduce per step carries, besides the gradients, the ranks' losses (for the mean
training loss) and a stop flag that rank 0 raises when the time budget runs out, so every
rank stops after the same step without an extra round trip.

Rank 0 evaluates (the others wait at the next all-reduce), writes ``eval`` events to
``OUT/metrics.jsonl`` and, at the end, ``OUT/report.json``. Every rank writes
``OUT/ranks/rank-R.json`` with its own counters and a hash of its final parameters.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import pathlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddiloco.baselines import netcount
from ddiloco.common import pacing
from ddiloco.common.device import pick_device
from ddiloco.common.config import RunConfig
from ddiloco.common.durable import write_json
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.model import parameter_count
from ddiloco.common.schedule import inner_lr
from ddiloco.workloads import load as load_workload
from ddiloco.workloads.checked import to_device
from ddiloco.workloads.evaluate import evaluate


@dataclass
class DPOptions:
    rank: int
    world_size: int
    out: pathlib.Path
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    device: str = "cpu"
    collective_timeout_s: float = 600.0  # a dead peer fails the others after this long
    step_seconds: float = 0.0  # > 0: each step's compute takes at least this long (dedicated hardware; common/pacing.py)


def validate(config: RunConfig, options: DPOptions) -> None:
    if options.world_size < 1:
        raise SystemExit(f"--world-size must be at least 1, got {options.world_size}")
    if not 0 <= options.rank < options.world_size:
        raise SystemExit(f"--rank must be in [0, {options.world_size}), got {options.rank}")
    if config.max_tokens <= 0 and config.max_seconds <= 0:
        raise SystemExit("give a budget: --max-tokens or --max-seconds")
    try:
        pacing.check(step_seconds=options.step_seconds)
    except ValueError as exc:
        raise SystemExit(f"--step-seconds: {exc}") from None


def params_sha256(params: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class Trainer:
    def __init__(self, config: RunConfig, options: DPOptions) -> None:
        validate(config, options)
        self.config = config
        self.options = options
        self.rank = options.rank
        self.world = options.world_size
        self.device = pick_device(options.device)
        self.metrics = MetricsLog(options.out / "metrics.jsonl", f"dp-rank-{self.rank}")
        cfg = config
        # W shards, exactly the split a ddiloco run with W learners trains on
        self.workload = load_workload(cfg)
        self.batches = self.workload.train_batches(self.rank, self.world, cfg.data.seed, 0)
        self.eval_batches = self.workload.eval_batches() if self.rank == 0 else None
        self.model = self.workload.build_model()
        if cfg.init_from:
            # every rank from the same saved model, so that dp and DiLoCo compared from one
            # warm start begin at the same point; the optimizer state starts fresh, as a
            # ddiloco run's learners' does (checked by the CLI before any rank starts)
            from ddiloco.modelio.source import load_into

            load_into(self.model, pathlib.Path(cfg.init_from), cfg)
        self.model = self.model.to(self.device)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay, betas=(0.9, 0.95)
        )
        self.tokens_per_rank_step = self.workload.reference_weight()
        global_step_tokens = self.world * self.tokens_per_rank_step
        # the budget is total tokens across ranks; round up so that at least the budget is trained
        self.max_steps = math.ceil(cfg.max_tokens / global_step_tokens) if cfg.max_tokens > 0 else None
        self.numel = sum(p.numel() for p in self.params)
        # gradients + [loss, stop flag], float32 on the wire
        self.payload_bytes = (self.numel + 2) * 4

    # ------------------------------------------------------------------ helpers
    def _eval(self, step: int, tokens: int) -> tuple[float, float | None]:
        assert self.eval_batches is not None
        loss, acc = evaluate(self.workload, self.model, self.eval_batches)  # acc None: no metric
        # ``version`` is the optimizer step, the counterpart of a ddiloco global version
        self.metrics.event("eval", version=step, tokens=tokens, eval_loss=round(loss, 5),
                           eval_accuracy=None if acc is None else round(acc, 5))
        return loss, acc

    def _allreduce(self, flat: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return flat
        # gloo reduces CPU tensors; on a GPU the copy is small next to the step itself
        host = flat.cpu() if flat.device.type != "cpu" else flat
        dist.all_reduce(host, op=dist.ReduceOp.SUM)
        host.div_(self.world)
        return host.to(flat.device) if host is not flat else host

    # ------------------------------------------------------------------ training
    def train(self) -> dict | None:
        cfg = self.config
        out = self.options.out
        if self.rank == 0:
            write_json(out / "config.json", __import__("json").loads(cfg.to_json()))
        self.metrics.event("dp_start", rank=self.rank, world_size=self.world, device=str(self.device), max_steps=self.max_steps,
                           step_seconds=self.options.step_seconds)
        initial_loss = initial_acc = None
        if self.rank == 0:
            initial_loss, initial_acc = self._eval(0, 0)
        tcp_start = netcount.snapshot()
        start = time.monotonic()
        last_eval = start
        compute_s = comm_s = eval_s = 0.0
        step = 0
        loss_sum, loss_n = 0.0, 0
        while self.max_steps is None or step < self.max_steps:
            t0 = time.perf_counter()
            batch = to_device(next(self.batches), self.device)
            for group in self.optimizer.param_groups:
                group["lr"] = inner_lr(self.config.learner.lr, self.config.learner.warmup_steps, step)
            loss = self.workload.loss(self.model, batch)
            self.optimizer.zero_grad(set_to_none=False)
            loss.backward()
            stop = 1.0 if (self.rank == 0 and time.monotonic() - start >= cfg.max_seconds) else 0.0
            flat = torch.cat(
                [p.grad.reshape(-1) for p in self.params] + [loss.detach().reshape(1), torch.tensor([stop], device=self.device)]
            )
            t1 = time.perf_counter()
            flat = self._allreduce(flat)
            t2 = time.perf_counter()
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))
                offset += n
            torch.nn.utils.clip_grad_norm_(self.params, cfg.learner.grad_clip)
            self.optimizer.step()
            mean_loss, stop_all = float(flat[-2]), float(flat[-1]) > 0  # .item() also syncs CUDA timing
            t3 = time.perf_counter()
            # emulated dedicated hardware: the step's compute (not its all-reduce) padded to
            # the learners' step time, so that the two are compared on the same hardware
            wait = pacing.step_wait((t1 - t0) + (t3 - t2), step_seconds=self.options.step_seconds)
            if wait > 0:
                time.sleep(wait)
            compute_s += (t1 - t0) + (t3 - t2) + wait
            comm_s += t2 - t1
            step += 1
            loss_sum += mean_loss
            loss_n += 1
            if self.rank == 0 and step % cfg.learner.inner_steps == 0:
                self.metrics.event("dp_window", steps=step, loss=round(loss_sum / loss_n, 5), tokens=step * self.world * self.tokens_per_rank_step)
                loss_sum, loss_n = 0.0, 0
            if stop_all:
                break
            if self.rank == 0 and time.monotonic() - last_eval >= cfg.outer.eval_interval_s:
                te = time.perf_counter()
                self._eval(step, step * self.world * self.tokens_per_rank_step)
                eval_s += time.perf_counter() - te
                last_eval = time.monotonic()
        if self.world > 1:
            dist.barrier()  # every rank's last all-reduce is complete (and acknowledged) before counting
        wall = time.monotonic() - start
        tcp_end = netcount.snapshot()
        measured = (tcp_end - tcp_start) if tcp_start is not None and tcp_end is not None else None
        tokens = step * self.tokens_per_rank_step
        mine = {
            "rank": self.rank,
            "tokens": tokens,
            "inner_steps": step,
            "compute_seconds": round(compute_s, 3),
            "allreduce_seconds": round(comm_s, 3),
            "wall_seconds": round(wall, 3),
            "bytes_sent": measured.sent if measured else None,
            "bytes_received": measured.received if measured else None,
            "params_sha256": params_sha256(self.params),
        }
        (out / "ranks").mkdir(exist_ok=True)
        write_json(out / "ranks" / f"rank-{self.rank}.json", mine)
        ranks = [mine]
        if self.world > 1:
            # every rank's counters through the files just written, not all_gather_object:
            # that unpickles what the other ranks send (tests/test_no_unsafe_deserialization.py)
            dist.barrier()
            ranks = [json.loads((out / "ranks" / f"rank-{r}.json").read_text()) for r in range(self.world)]
        self.metrics.event("dp_stop", rank=self.rank, steps=step, tokens=tokens)
        if self.rank != 0:
            return None
        final_loss, final_acc = self._eval(step, step * self.world * self.tokens_per_rank_step)
        report = self._report(ranks, step, wall, initial_loss, initial_acc, final_loss, final_acc, eval_s)
        write_json(out / "report.json", report)
        self.metrics.event("finished", final_eval_loss=final_loss, steps=step)
        return report

    def _report(self, ranks, steps, wall, initial_loss, initial_acc, final_loss, final_acc, eval_s) -> dict:
        computed = steps * 2 * netcount.ring_allreduce_bytes(self.payload_bytes, self.world)
        measured = all(r["bytes_sent"] is not None for r in ranks)
        per_rank = [r["bytes_sent"] + r["bytes_received"] for r in ranks] if measured else [computed] * len(ranks)
        return {
            "run_id": self.config.run_id,
            "method": "dp" if self.world > 1 else "single",
            "world_size": self.world,
            "initial_eval_loss": initial_loss,
            "initial_eval_accuracy": initial_acc,
            "final_eval_loss": final_loss,
            "final_eval_accuracy": final_acc,
            "tokens_trained": sum(r["tokens"] for r in ranks),
            "optimizer_steps": steps,
            "global_batch_tokens": self.world * self.tokens_per_rank_step,
            "wall_seconds": round(wall, 3),
            "compute_seconds": round(sum(r["compute_seconds"] for r in ranks), 3),
            "allreduce_seconds": round(sum(r["allreduce_seconds"] for r in ranks), 3),
            "eval_seconds": round(eval_s, 3),
            "model_parameters": parameter_count(self.model),
            # per rank, sent + received, mean over ranks (see docs/quality.md)
            "bytes_exchanged": int(sum(per_rank) / len(per_rank)),
            "bytes_exchanged_source": "tcp_info" if measured else "computed",
            "bytes_exchanged_computed": computed,
            "bytes_total": int(sum(per_rank) / 2),  # each byte is sent by one rank and received by another
            "ranks_in_sync": len({r["params_sha256"] for r in ranks}) == 1,
            "ranks": ranks,
        }


def run_rank(config: RunConfig, options: DPOptions) -> dict | None:
    """Train one rank to the end of the budget; rank 0 returns the report."""
    validate(config, options)
    options.out.mkdir(parents=True, exist_ok=True)
    config.learners = options.world_size  # the run's M is the world size
    if options.world_size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{options.master_addr}:{options.master_port}",
            rank=options.rank,
            world_size=options.world_size,
            timeout=datetime.timedelta(seconds=options.collective_timeout_s),
        )
    try:
        report = Trainer(config, options).train()
        if options.world_size > 1:
            # rank 0 evaluates after the others are done: wait for it, so that no rank tears
            # its pairs down while a peer's last collective may still be using them
            dist.barrier()
        return report
    finally:
        if options.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
