"""The simplest workload: a small MLP fits a fixed nonlinear function of 8 inputs.

Run it with two learners on this machine::

    ddiloco run --workload examples/mlp_regression.py:workload --learners 2 --max-seconds 30

Options (``--workload-arg KEY=VALUE``): ``hidden`` (units, default 32), ``batch``
(samples per batch, default 32).

Everything is generated, so nothing is downloaded: an input is 8 standard normal numbers,
its target a fixed function of them (a sum of sines of fixed projections, plus a product
of two inputs). Batch ``k`` of a shard is drawn from a generator seeded by (seed, shard,
k) alone, which is what makes ``train_batches(..., start=k)`` resume exactly at batch k.
The held-out set is drawn from its own seed, apart from every shard's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM = 8
EVAL_SEED = 2**61 - 1  # the held-out stream, far from any (seed, shard, batch) of training
EVAL_BATCHES, EVAL_BATCH = 4, 256


def stream_seed(seed: int, shard: int, index: int) -> int:
    """One generator seed per batch, a pure function of where the batch is."""
    return ((seed * 1_000_003 + shard) * 1_000_033 + index) % (2**61 - 1)


# the function to learn: fixed projections, the same in every process, small enough that
# the sines vary smoothly (a few hundred steps fit most of it; unscaled, a few thousand)
_PROJ = 0.4 * torch.randn(DIM, 4, generator=torch.Generator().manual_seed(7))


def target(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x @ _PROJ).sum(-1) + 0.5 * x[:, 0] * x[:, 1]


class MLPRegression:
    def __init__(self, hidden: int, batch: int) -> None:
        self.hidden, self.batch = hidden, batch

    def model(self) -> nn.Module:
        # ddiloco seeds the global RNG with the run's seed before calling this
        return nn.Sequential(nn.Linear(DIM, self.hidden), nn.Tanh(), nn.Linear(self.hidden, self.hidden), nn.Tanh(),
                             nn.Linear(self.hidden, 1))

    def _draw(self, gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, DIM, generator=gen)
        return x, target(x)

    def train_batches(self, shard: int, num_shards: int, seed: int, start: int):
        index = start
        while True:
            yield self._draw(torch.Generator().manual_seed(stream_seed(seed, shard, index)), self.batch)
            index += 1

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x).squeeze(-1), y)

    def batch_weight(self, batch) -> int:
        return batch[0].shape[0]  # samples

    def eval_batches(self):
        gen = torch.Generator().manual_seed(EVAL_SEED)
        return [self._draw(gen, EVAL_BATCH) for _ in range(EVAL_BATCHES)]


def workload(args) -> MLPRegression:
    known = {"hidden": 32, "batch": 32}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"unknown options {unknown}; this workload takes {sorted(known)}")
    values = {k: int(args.get(k, v)) for k, v in known.items()}
    if min(values.values()) < 1:
        raise ValueError(f"hidden and batch must be positive integers, got {values}")
    return MLPRegression(**values)
