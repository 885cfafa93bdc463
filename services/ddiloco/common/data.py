"""Text corpus, deterministic shards and batches.

The built-in corpus needs no download: the CPython standard library's own documentation
(``pydoc_data.topics``) and its source files, read in sorted order up to a byte budget.
``DataConfig.path`` points at a file or folder of the user's text instead.

Documents (one per topic or file) are split deterministically: every n-th document is held
out for evaluation and no learner ever trains on it; the rest are dealt round-robin to the
shards, one shard per learner.

A shard is read as windows of ``context + 1`` bytes in an order that is a seeded
permutation per epoch. Batch ``k`` of a shard is always the same bytes, so a learner that
restarts resumes exactly by batch index (see ``ShardSampler.batch``).
"""

from __future__ import annotations

import os
import pathlib
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch

from ddiloco.common.config import DataConfig

SEPARATOR = b"\n\n"
_SKIP_DIRS = {"test", "tests", "site-packages", "idlelib", "tkinter", "turtledemo", "__pycache__", "lib2to3"}


def builtin_documents(max_bytes: int) -> list[tuple[str, bytes]]:
    """pydoc topics first, then standard-library sources in sorted path order."""
    import pydoc_data.topics

    docs: list[tuple[str, bytes]] = []
    total = 0
    for name in sorted(pydoc_data.topics.topics):
        text = pydoc_data.topics.topics[name].encode("utf-8")
        docs.append((f"pydoc:{name}", text))
        total += len(text)
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in _sorted_files(stdlib, suffix=".py"):
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        docs.append((str(path.relative_to(stdlib)), data))
        total += len(data)
    return docs


def _sorted_files(root: pathlib.Path, suffix: str | None) -> list[pathlib.Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if suffix is None or name.endswith(suffix):
                out.append(pathlib.Path(dirpath) / name)
    return sorted(out)


def user_documents(path: str, max_bytes: int) -> list[tuple[str, bytes]]:
    root = pathlib.Path(path)
    if not root.exists():
        raise FileNotFoundError(f"--data {path}: no such file or folder")
    files = [root] if root.is_file() else _sorted_files(root, suffix=None)
    docs, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        data = f.read_bytes()[: max_bytes - total]
        if data:
            docs.append((str(f), data))
            total += len(data)
    if not docs:
        raise ValueError(f"--data {path}: no text found")
    return docs


@dataclass
class Corpus:
    shards: list[np.ndarray]  # uint8, one per learner
    eval_bytes: np.ndarray
    shard_docs: list[list[str]]  # document names in each shard
    eval_docs: list[str]

    def describe(self) -> dict:
        return {"shard_bytes": [int(s.size) for s in self.shards], "eval_bytes": int(self.eval_bytes.size)}


def load_corpus(cfg: DataConfig, num_shards: int) -> Corpus:
    docs = user_documents(cfg.path, cfg.max_bytes) if cfg.path else builtin_documents(cfg.max_bytes)
    if len(docs) < cfg.eval_every_nth_doc:
        # Too few documents to hold whole ones out: hold out the tail of each instead.
        cut = lambda d: int(len(d) * (1 - 1 / cfg.eval_every_nth_doc))  # noqa: E731
        train_docs = [(n, d[: cut(d)]) for n, d in docs]
        eval_docs = [(n + ":tail", d[cut(d) :]) for n, d in docs]
    else:
        eval_docs = [d for i, d in enumerate(docs) if i % cfg.eval_every_nth_doc == cfg.eval_every_nth_doc - 1]
        train_docs = [d for i, d in enumerate(docs) if i % cfg.eval_every_nth_doc != cfg.eval_every_nth_doc - 1]
    shards: list[list[bytes]] = [[] for _ in range(num_shards)]
    names: list[list[str]] = [[] for _ in range(num_shards)]
    if len(train_docs) >= num_shards:
        for i, (name, data) in enumerate(train_docs):
            shards[i % num_shards].append(data)
            names[i % num_shards].append(name)
    else:  # few large documents: cut the stream into equal contiguous pieces instead
        stream = SEPARATOR.join(d for _, d in train_docs)
        step = len(stream) // num_shards
        for i in range(num_shards):
            shards[i].append(stream[i * step : (i + 1) * step])
            names[i].append(f"stream[{i}]")
    as_array = lambda parts: np.frombuffer(SEPARATOR.join(parts), dtype=np.uint8).copy()  # noqa: E731
    return Corpus(
        shards=[as_array(s) for s in shards],
        eval_bytes=as_array([d for _, d in eval_docs]),
        shard_docs=names,
        eval_docs=[n for n, _ in eval_docs],
    )


def check_shards(corpus: Corpus, context: int, batch_size: int) -> None:
    """Raise ``ValueError`` unless every shard holds one batch of ``batch_size`` windows of
    ``context + 1`` bytes (what ``ShardSampler`` needs), naming the smallest shard. Reads
    only the shards' sizes, so it stays cheap for the largest learner count."""
    need = batch_size * context + 1
    sizes = [int(s.size) for s in corpus.shards]
    smallest = min(range(len(sizes)), key=sizes.__getitem__)
    if sizes[smallest] < need:
        short = sum(1 for size in sizes if size < need)
        raise ValueError(
            f"shard {smallest} of {len(sizes)} (the smallest) holds {sizes[smallest]:,} bytes, but one batch of "
            f"{batch_size} windows of {context} bytes needs {need:,} (shards below that: {short:,} of "
            f"{len(sizes):,}); use fewer learners (--learners) or more data (--data-bytes, --data)"
        )


class ShardSampler:
    """Deterministic batches of (context + 1)-byte windows from one shard."""

    def __init__(self, data: np.ndarray, context: int, batch_size: int, seed: int) -> None:
        self.data = torch.from_numpy(data.astype(np.int64))
        self.context = context
        self.batch_size = batch_size
        self.seed = seed
        self.n_windows = (len(data) - 1) // context
        if self.n_windows < batch_size:
            raise ValueError(
                f"shard of {len(data)} bytes holds {self.n_windows} windows of {context} bytes, "
                f"fewer than one batch of {batch_size}"
            )
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.n_windows, generator=gen)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``index`` (from 0): inputs and next-byte targets, each (B, context)."""
        rows = []
        for j in range(index * self.batch_size, (index + 1) * self.batch_size):
            epoch, k = divmod(j, self.n_windows)
            start = int(self._permutation(epoch)[k]) * self.context
            rows.append(self.data[start : start + self.context + 1])
        xy = torch.stack(rows)
        return xy[:, :-1], xy[:, 1:]


def eval_windows(eval_bytes: np.ndarray, context: int, count: int) -> torch.Tensor:
    """``count`` evenly spaced windows of context + 1 bytes from the held-out text."""
    n = (len(eval_bytes) - 1) // context
    if n < 1:
        raise ValueError(f"held-out text of {len(eval_bytes)} bytes is shorter than one window")
    picks = np.linspace(0, n - 1, num=min(count, n)).astype(np.int64)
    data = torch.from_numpy(eval_bytes.astype(np.int64))
    return torch.stack([data[i * context : i * context + context + 1] for i in picks])


class CorpusCache:
    """The run's corpus split for a shard count, read once per count (the learners' M, or
    dp's world size): every workload that trains on the built-in text holds one."""

    def __init__(self, data) -> None:
        self.data = data
        self._by_count: dict[int, Corpus] = {}

    def __call__(self, num_shards: int) -> Corpus:
        if num_shards not in self._by_count:
            self._by_count[num_shards] = load_corpus(self.data, num_shards)
        return self._by_count[num_shards]
