"""Workloads: what a run trains (the model, its data, its loss), behind one small API.

A workload is named ``module:function`` (or ``path/to/file.py:function``); the function
takes the run's workload options (a dict of ``--workload-arg KEY=VALUE`` strings, with the
run configuration at ``.run``) and returns an object with ``model()``,
``train_batches(shard, num_shards, seed, start)``, ``loss(model, batch)``,
``batch_weight(batch)``, ``eval_batches()`` and optionally ``metric(model, batch)``.
``docs/workloads.md`` is the user's description; this package is the only place the
learner, the outer optimizer, the coordinator and the baselines meet a model or a batch.

* ``loader``: resolve the name, call the function, check the object has the methods.
* ``errors``: ``WorkloadError`` and the required methods, without torch.
* ``bytegpt_options``: the built-in workload's options rule, without torch.
* ``checked``: the object wrapped so that every value it returns is checked where it is
  used (a weight that is not a positive int, a loss that is not a finite scalar), with a
  message naming the workload.
* ``evaluate``: the held-out mean loss (and metric) of a model.
* ``bytegpt``: the built-in byte-level GPT on text, the default.
* ``hf``: a Hugging Face causal LM built from a config (optional extra ``[hf]``).
"""

from ddiloco.workloads.errors import WorkloadError
from ddiloco.workloads.loader import DEFAULT_WORKLOAD, check, load, resolve

__all__ = ["DEFAULT_WORKLOAD", "Workload", "WorkloadError", "check", "load", "resolve"]


def __getattr__(name: str):
    # Workload (the checked wrapper) imports torch: only on first use, so that importing this
    # package to check a configuration does not import torch
    if name == "Workload":
        from ddiloco.workloads.checked import Workload

        return Workload
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
