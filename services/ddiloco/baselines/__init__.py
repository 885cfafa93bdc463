"""Baselines that ddiloco is measured against, on the same model, data and token budget.

- ``dp``: synchronous data-parallel training. W processes all-reduce their gradients every
  step (torch.distributed, gloo); world size 1 is the single-learner baseline.
- Synchronous DiLoCo needs no code here: it is ``ddiloco run --sync --quorum M``.
"""
