"""A Hugging Face causal language model on the run's text (``ddiloco.workloads.hf:workload``).

Needs ``transformers`` (the optional extra: ``pip install -e '.[hf]'``). The model is built
from a configuration only, never downloaded: ``--workload-arg config=NAME`` picks a preset
below, ``config=PATH`` reads a local ``config.json`` (a file, or a folder holding one) with
its ``model_type`` (``gpt2``, ``llama``, ...). Its weights start from the configuration's
own initialisation under the run's seed.

The data are the built-in workload's (the run's ``--data`` text or the CPython corpus, the
same shards and held-out documents, ``ddiloco.common.data``) read as bytes: token ids 0-255,
so no tokenizer is needed and the configuration's ``vocab_size`` must be at least 256.
A batch is ``(inputs, targets)`` of ``batch x context`` ids, worth its ``batch x context``
target tokens; the loss is next-token cross-entropy, the metric next-token accuracy.

Options: ``config`` (default ``gpt2-tiny``), ``context`` (tokens per sequence, default 64,
at most the model's positions), ``batch`` (sequences per batch, default the run's
``--batch-size``).
"""

from __future__ import annotations

import json
import pathlib
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddiloco.common.data import CorpusCache, ShardSampler, check_shards, eval_windows
from ddiloco.workloads.checked import WorkloadError

BYTES = 256
EVAL_BATCH = 16

# small configurations for tests and laptops; dropout off so a step is a function of its batch
PRESETS: dict[str, dict] = {
    "gpt2-tiny": {"model_type": "gpt2", "vocab_size": BYTES, "n_positions": 128, "n_embd": 64, "n_layer": 2, "n_head": 2,
                  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0},
    "llama-tiny": {"model_type": "llama", "vocab_size": BYTES, "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                   "max_position_embeddings": 128},
}
OPTIONS = ("config", "context", "batch")

Batch = tuple[torch.Tensor, torch.Tensor]


def _config_dict(spec: str) -> dict:
    if spec in PRESETS:
        return dict(PRESETS[spec])
    path = pathlib.Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise WorkloadError(f"hf workload: config={spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"hf workload: {path}: not a JSON configuration: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise WorkloadError(f"hf workload: {path}: a configuration needs a model_type (gpt2, llama, ...)")
    return data


def _positions(config) -> int | None:
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


class HFCausalLM:
    def __init__(self, run, config, context: int, batch: int) -> None:
        self.run = run
        self.config = config
        self.context = context
        self.batch = batch
        self._corpus = CorpusCache(run.data)

    def model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(self.config)
        model.config.use_cache = False  # training: no key/value cache
        return model

    def train_batches(self, shard: int, num_shards: int, seed: int, start: int) -> Iterator[Batch]:
        sampler = ShardSampler(self._corpus(num_shards).shards[shard], self.context, self.batch, seed=seed + shard)
        index = start
        while True:
            yield sampler.batch(index)
            index += 1

    def check_data(self, num_shards: int) -> None:
        check_shards(self._corpus(num_shards), self.context, self.batch)

    def _logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x).logits

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        logits = self._logits(model, x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def batch_weight(self, batch: Batch) -> int:
        return batch[1].numel()

    def eval_batches(self) -> list[Batch]:
        windows = eval_windows(self._corpus(self.run.learners).eval_bytes, self.context, self.run.data.eval_windows)
        return [(w[:, :-1], w[:, 1:]) for w in windows.split(EVAL_BATCH)]

    def metric(self, model: nn.Module, batch: Batch) -> float:
        x, y = batch
        return int((self._logits(model, x).argmax(-1) == y).sum()) / y.numel()


def workload(args) -> HFCausalLM:
    unknown = sorted(set(args) - set(OPTIONS))
    if unknown:
        raise WorkloadError(f"hf workload: unknown options {unknown}; it takes {', '.join(OPTIONS)}")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise WorkloadError("hf workload: transformers is not installed (pip install -e '.[hf]')") from None
    data = _config_dict(args.get("config", "gpt2-tiny"))
    model_type = data.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as exc:
        raise WorkloadError(f"hf workload: model_type {model_type!r}: {exc}") from None
    if getattr(config, "vocab_size", 0) < BYTES:
        raise WorkloadError(f"hf workload: vocab_size {getattr(config, 'vocab_size', None)} is below {BYTES}: the tokens are bytes")
    try:
        context = int(args.get("context", 64))
        batch = int(args.get("batch", args.run.learner.batch_size))
    except ValueError as exc:
        raise WorkloadError(f"hf workload: context and batch are integers: {exc}") from None
    positions = _positions(config)
    if context < 2 or (positions is not None and context > positions):
        raise WorkloadError(f"hf workload: context must be 2 to the model's {positions} positions, got {context}")
    if batch < 1:
        raise WorkloadError(f"hf workload: batch must be at least 1, got {batch}")
    return HFCausalLM(args.run, config, context, batch)
