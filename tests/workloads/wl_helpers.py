"""Workload modules written into a test's folder, and the run configuration naming them."""

from __future__ import annotations

import pathlib
import textwrap

from ddiloco.common.config import RunConfig, WorkloadConfig

# a minimal correct workload; tests replace one method to break it
GOOD = '''
import torch, torch.nn as nn

class W:
    def model(self):
        return nn.Linear(4, 1)
    def train_batches(self, shard, num_shards, seed, start):
        i = start
        while True:
            g = torch.Generator().manual_seed(seed * 1000 + shard * 100 + i)
            yield torch.randn(8, 4, generator=g)
            i += 1
    def loss(self, model, batch):
        return model(batch).pow(2).mean()
    def batch_weight(self, batch):
        return batch.shape[0]
    def eval_batches(self):
        return [torch.ones(8, 4)]
{extra}
def workload(args):
    return W()
'''


def write(folder: pathlib.Path, extra: str = "", source: str | None = None, name: str = "wl.py") -> str:
    """Write a workload module; ``extra``: methods (indented 4) that override ``GOOD``'s."""
    text = source if source is not None else GOOD.replace("{extra}", textwrap.indent(textwrap.dedent(extra), "    "))
    path = folder / name
    path.write_text(text)
    return f"{path}:workload"


def config(name: str, args: dict[str, str] | None = None, **kw) -> RunConfig:
    cfg = RunConfig(workload=WorkloadConfig(name=name, args=dict(args or {})), **kw)
    return cfg
