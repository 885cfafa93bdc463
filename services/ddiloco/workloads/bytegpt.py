"""The built-in workload: a byte-level GPT on text (``ddiloco.workloads.bytegpt:workload``).

The model is ``ddiloco.common.model.GPT`` of the run's ``model`` section (``--model``), the
text the run's ``data`` section (``--data``, default the CPython documentation and
sources), split by ``ddiloco.common.data``: held-out documents for evaluation, the rest
dealt to ``num_shards`` shards. A batch is ``(inputs, targets)``, each ``(batch_size,
context)`` bytes, worth its ``batch_size x context`` target tokens.

This is the recipe ddiloco trained before workloads existed, step for step: the same
initial weights (``build_model`` with the run's seed), the same batches in the same order
(batch ``k`` of shard ``s`` is ``ShardSampler(seed = data seed + s).batch(k)``), the same
loss and the same evaluation windows (tests/workloads/test_bytegpt_identity.py).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

from ddiloco.common.data import CorpusCache, ShardSampler, check_shards, eval_windows
from ddiloco.common.model import build_model
from ddiloco.workloads.bytegpt_options import check_options

EVAL_BATCH = 16  # windows per evaluation batch (the former evaluate()'s batch)

Batch = tuple[torch.Tensor, torch.Tensor]


class ByteGPT:
    def __init__(self, run) -> None:
        self.run = run
        self._corpus = CorpusCache(run.data)

    def model(self) -> nn.Module:
        return build_model(self.run.model, self.run.seed)

    def train_batches(self, shard: int, num_shards: int, seed: int, start: int) -> Iterator[Batch]:
        corpus = self._corpus(num_shards)
        sampler = ShardSampler(corpus.shards[shard], self.run.model.context, self.run.learner.batch_size, seed=seed + shard)
        index = start
        while True:  # batch k is a pure function of k: epochs follow each other endlessly
            yield sampler.batch(index)
            index += 1

    def check_data(self, num_shards: int) -> None:
        check_shards(self._corpus(num_shards), self.run.model.context, self.run.learner.batch_size)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return model(x, y)[1]

    def batch_weight(self, batch: Batch) -> int:
        return batch[1].numel()

    def eval_batches(self) -> list[Batch]:
        # the evaluation set does not depend on the shard count; read it with the run's
        windows = eval_windows(self._corpus(self.run.learners).eval_bytes, self.run.model.context, self.run.data.eval_windows)
        return [(w[:, :-1], w[:, 1:]) for w in windows.split(EVAL_BATCH)]

    def metric(self, model: nn.Module, batch: Batch) -> float:
        """Next-byte accuracy."""
        x, y = batch
        logits, _ = model(x)
        return int((logits.argmax(-1) == y).sum()) / y.numel()


def workload(args) -> ByteGPT:
    check_options(args)
    return ByteGPT(args.run)
