"""The held-out evaluation of a model: its mean loss over the workload's eval batches.

The mean is weighted by ``batch_weight`` (per token for a language model, per sample for a
classifier), so a short last batch counts for what it holds. The metric (accuracy, where
the workload defines one) is averaged with the same weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddiloco.workloads.checked import Workload, to_device


@torch.no_grad()
def evaluate(workload: Workload, model: nn.Module, batches: list | None = None) -> tuple[float, float | None]:
    """``(mean loss, mean metric or None)`` of ``model`` over ``batches`` (default: the
    workload's eval batches), in eval mode; the model's training mode is restored."""
    batches = workload.eval_batches() if batches is None else batches
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total_loss, total_metric, count = 0.0, 0.0, 0
    try:
        for batch in batches:
            batch = to_device(batch, device)
            weight = workload.batch_weight(batch)
            total_loss += float(workload.loss(model, batch)) * weight
            if workload.has_metric:
                total_metric += workload.metric(model, batch) * weight
            count += weight
    finally:
        model.train(was_training)
    # not checked for finiteness: a diverged model's NaN is what an evaluation should report
    return total_loss / count, (total_metric / count if workload.has_metric else None)
