"""Rank r > 0 of a learner group (``python -m ddiloco.learner.rank``; started by rank 0, see
``ddiloco.learner.group``). It speaks no gRPC: it receives from rank 0 what to build and
where to read, a copy of the replica and, each step, whether to go on and which fragments
changed; it trains on its own batches and joins the gradient average."""

from __future__ import annotations

import argparse
import copy
import logging

import torch
import torch.distributed as dist

from ddiloco.common.cliargs import limit_threads, setup_logging
from ddiloco.common.config import RunConfig
from ddiloco.common.fragments import partition
from ddiloco.common.schedule import inner_lr
from ddiloco.learner.group import (
    broadcast_json,
    COLLECTIVE_TIMEOUT, average_gradients, backend_for, joined_key, local_only, receive_or_send, share_moments,
    strided, watch_parent,
)
from ddiloco.workloads import load
from ddiloco.workloads.checked import to_device

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco.learner.rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True, help="tcp://127.0.0.1:PORT, rank 0's rendezvous")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parent", type=int, required=True, help="rank 0's pid: this process ends with it")
    args = parser.parse_args(argv)
    setup_logging(f"learner-rank-{args.rank}")
    limit_threads(args.threads)
    watch_parent(args.parent)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", args.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    local_only(backend_for(device))
    host, port = args.init.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), args.world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.set(joined_key(args.rank), "1")  # rank 0 watches for this while the group forms
    dist.init_process_group(backend_for(device), store=store, rank=args.rank, world_size=args.world,
                            timeout=COLLECTIVE_TIMEOUT)
    train(args.rank, args.world, device)
    dist.destroy_process_group()
    return 0


def train(rank: int, world: int, device: torch.device) -> None:
    setup = broadcast_json(None, device)
    cfg = RunConfig.from_json(setup["config"])
    if setup["batch_size"]:
        cfg = copy.deepcopy(cfg)
        cfg.learner.batch_size = setup["batch_size"]
    workload = load(cfg)
    model = workload.build_model().to(device)
    params = list(model.parameters())
    for p in params:
        dist.broadcast(p.data, src=0)
    fragments = partition([p.numel() for p in params], cfg.fragments)
    lc = cfg.learner
    optimizer = torch.optim.AdamW(params, lr=lc.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.95))
    if setup.get("adam_step", 0) > 0:  # rank 0 restored its moments after a restart
        share_moments(optimizer, params, setup["adam_step"])
    schedule_step = setup.get("schedule_step", 0)
    start = setup["batch_index"] + rank
    batches = strided(workload.train_batches(setup["shard"], cfg.learners, cfg.data.seed, start), world)
    model.train()
    log.info("rank %d of %d: shard %d from batch %d", rank, world, setup["shard"], start)
    step = 0
    while True:
        control_t = torch.zeros(1 + len(fragments), dtype=torch.int64, device=device)
        dist.broadcast(control_t, src=0)
        control = [int(c) for c in control_t.tolist()]
        if control[0]:
            break
        receive_or_send(params, fragments, control)
        batch = to_device(next(batches), device)
        weight = workload.batch_weight(batch)
        for group in optimizer.param_groups:  # the learner's schedule: warmup counted in group steps
            group["lr"] = inner_lr(lc.lr, lc.warmup_steps, schedule_step + step)
        loss = workload.loss(model, batch)
        loss_value = workload.check_finite(float(loss.detach()), f"at rank {rank}, step {step} of shard {setup['shard']}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(params, loss_value, weight, world, device)
        torch.nn.utils.clip_grad_norm_(params, lc.grad_clip)
        optimizer.step()
        step += 1
    log.info("rank %d: stopped after %d steps", rank, step)


if __name__ == "__main__":
    raise SystemExit(main())
