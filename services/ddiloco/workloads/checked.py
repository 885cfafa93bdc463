"""A workload object, wrapped so that what it returns is checked where ddiloco uses it.

The user's object is trusted for nothing: a weight that is not a positive integer would
corrupt the token-weighted merge and every budget, a loss that is not a finite scalar would
train NaNs into a delta, and a model built twice with different parameters would make the
learners' deltas meaningless. Each check raises ``WorkloadError`` with the workload's name,
the method and what it returned.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterator

import torch
import torch.nn as nn

from ddiloco.workloads.errors import REQUIRED, WorkloadError

__all__ = ["REQUIRED", "Workload", "WorkloadError", "to_device"]


class Workload:
    """The checked face of a workload (``loader.load`` builds it)."""

    def __init__(self, name: str, impl: Any, run) -> None:
        self.name = name
        self.impl = impl
        self.run = run
        self._reference_weight: int | None = None

    def error(self, what: str) -> WorkloadError:
        return WorkloadError(f"workload {self.name!r}: {what}")

    # ------------------------------------------------------------------ the model
    def build_model(self) -> nn.Module:
        """``model()`` with the global RNG seeded by the run's seed (and restored after), so
        every process that builds it gets the same initial parameters."""
        state = torch.random.get_rng_state()
        torch.manual_seed(self.run.seed)
        try:
            model = self.impl.model()
        finally:
            torch.random.set_rng_state(state)
        if not isinstance(model, nn.Module):
            raise self.error(f"model() returned a {type(model).__name__}, not a torch.nn.Module")
        named = list(model.named_parameters())
        if not named:
            raise self.error("model() returned a module without parameters: there is nothing to train")
        bad = [n for n, p in named if not p.is_floating_point()]
        if bad:
            raise self.error(f"model() has parameters that are not floating point: {bad[:5]}")
        return model

    def embedding_names(self, model: nn.Module) -> set[str]:
        """Parameters owned by ``nn.Embedding`` modules: the merge averages these plainly
        (ddiloco.common.merge, rule rda), as a row only moves when its token is seen."""
        params = {id(p): n for n, p in model.named_parameters()}
        out = set()
        for module in model.modules():
            if isinstance(module, nn.Embedding) and id(module.weight) in params:
                out.add(params[id(module.weight)])
        return out

    # ------------------------------------------------------------------ data
    def train_batches(self, shard: int, num_shards: int, seed: int, start: int) -> Iterator[Any]:
        """Batches ``start, start + 1, ...`` of ``shard``; the stream must not end."""
        source = self.impl.train_batches(shard, num_shards, seed, start)
        try:
            it = iter(source)
        except TypeError:
            raise self.error(f"train_batches() returned a {type(source).__name__}, not an iterator") from None
        return self._endless(it, shard, start)

    def check_data(self, num_shards: int) -> None:
        """The optional ``check_data(num_shards)``: raises ``WorkloadError`` when some shard
        could not give a batch, so that the run is refused before a learner dies at its
        first batch (the preflight tries batches of shard 0 only)."""
        check = getattr(self.impl, "check_data", None)
        if check is None:
            return
        try:
            check(num_shards)
        except WorkloadError:
            raise
        except ValueError as exc:
            raise self.error(str(exc)) from None

    def _endless(self, it: Iterator[Any], shard: int, start: int) -> Iterator[Any]:
        index = start
        for batch in it:
            yield batch
            index += 1
        raise self.error(
            f"train_batches(shard={shard}) ended after batch {index}; it must never end (start another epoch instead)"
        )

    def batch_weight(self, batch: Any) -> int:
        """What the batch is worth (tokens or samples): a positive integer."""
        w = self.impl.batch_weight(batch)
        if isinstance(w, bool):
            raise self.error(f"batch_weight() returned {w!r}; it must be a positive integer")
        if isinstance(w, torch.Tensor) and w.numel() == 1 and not w.is_floating_point():
            w = int(w.item())
        try:
            value = operator.index(w)
        except TypeError:
            raise self.error(f"batch_weight() returned {w!r} ({type(w).__name__}); it must be a positive integer") from None
        if value <= 0:
            raise self.error(f"batch_weight() returned {value}; it must be a positive integer")
        return value

    def reference_weight(self) -> int:
        """The weight of batch 0 of shard 0: the run's nominal weight of one inner step, the
        same in every process. A synchronous round is ``learners x H x`` this many tokens
        (the work clock); budgets and admission bounds scale with it."""
        if self._reference_weight is None:
            batch = next(self.train_batches(0, self.run.learners, self.run.data.seed, 0))
            self._reference_weight = self.batch_weight(batch)
        return self._reference_weight

    def step_weight(self) -> int:
        """The run's nominal weight of one learner's inner step: a learner of R ranks
        (``learner.ranks``) consumes R batches per step."""
        return self.run.learner.ranks * self.reference_weight()

    def round_tokens(self) -> int:
        """Tokens of one synchronous DiLoCo round: M learners x H steps x the step weight."""
        return self.run.learners * self.run.learner.inner_steps * self.step_weight()

    def eval_batches(self) -> list[Any]:
        batches = self.impl.eval_batches()
        try:
            out = list(batches)
        except TypeError:
            raise self.error(f"eval_batches() returned a {type(batches).__name__}, not an iterable") from None
        if not out:
            raise self.error("eval_batches() is empty; the held-out set needs at least one batch")
        return out

    def batches_before(self, shard: int, num_shards: int, seed: int, tokens: int) -> int:
        """How many whole batches of ``shard``, read from its start, fit in ``tokens``:
        where a learner resumes once ``tokens`` of its work are acknowledged. Reads the
        weights of the batches again (no model runs); a learner's acknowledged work is
        always a whole number of its batches."""
        if tokens <= 0:
            return 0
        total, count = 0, 0
        for batch in self.train_batches(shard, num_shards, seed, 0):
            total += self.batch_weight(batch)
            if total > tokens:
                return count
            count += 1
            if total == tokens:
                return count
        raise AssertionError("unreachable: train_batches never ends")

    # ------------------------------------------------------------------ loss and metric
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The batch's loss: a scalar tensor (finite is checked by ``check_finite``, where
        its value is read anyway)."""
        loss = self.impl.loss(model, batch)
        if not isinstance(loss, torch.Tensor):
            raise self.error(f"loss() returned a {type(loss).__name__}, not a torch.Tensor")
        if loss.dim() != 0:
            raise self.error(f"loss() returned a tensor of shape {tuple(loss.shape)}; it must be a scalar")
        if not loss.is_floating_point():
            raise self.error(f"loss() returned a {loss.dtype} tensor; it must be floating point")
        return loss

    def check_finite(self, value: float, where: str) -> float:
        if not math.isfinite(value):
            raise self.error(f"loss() is {value} {where}; nothing of this work is sent")
        return value

    @property
    def has_metric(self) -> bool:
        return getattr(self.impl, "metric", None) is not None

    def metric(self, model: nn.Module, batch: Any) -> float:
        value = self.impl.metric(model, batch)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise self.error(f"metric() returned {value!r}; it must be a number") from None


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (nested tuples, lists, dicts) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
