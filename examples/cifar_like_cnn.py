"""A small CNN classifies generated 16x16 colour images, CIFAR-style, by a learnable rule.

Run it with two learners on this machine::

    ddiloco run --workload examples/cifar_like_cnn.py:workload --learners 2 --max-seconds 60

Options (``--workload-arg KEY=VALUE``): ``batch`` (images per batch, default 32),
``width`` (channels of the first convolution, default 8).

An image is noise in 3 channels with one bright 4x4 square in one of its four quadrants
(anywhere inside it, in a random channel); its class is the quadrant (4 classes). The
position inside the quadrant and the channel vary, so the network has to learn where
brightness is, not one pixel: a convolution and pooling do it, a lookup cannot. Batch
``k`` of a shard comes from a generator seeded by (seed, shard, k) alone, so
``train_batches(..., start=k)`` resumes exactly there. The metric is accuracy.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZE, CLASSES, SQUARE = 16, 4, 4
EVAL_SEED = 2**61 - 2
EVAL_BATCHES, EVAL_BATCH = 4, 128


def stream_seed(seed: int, shard: int, index: int) -> int:
    return ((seed * 1_000_003 + shard) * 1_000_033 + index) % (2**61 - 1)


def draw(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    images = 0.5 * torch.randn(n, 3, SIZE, SIZE, generator=gen)
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    half = SIZE // 2
    offsets = torch.randint(0, half - SQUARE + 1, (n, 2), generator=gen)
    channels = torch.randint(0, 3, (n,), generator=gen)
    for i in range(n):
        row = (int(labels[i]) // 2) * half + int(offsets[i, 0])
        col = (int(labels[i]) % 2) * half + int(offsets[i, 1])
        images[i, int(channels[i]), row : row + SQUARE, col : col + SQUARE] += 2.0
    return images, labels


class SmallCNN(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.head = nn.Linear(2 * width * (SIZE // 4) ** 2, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


class CifarLike:
    def __init__(self, batch: int, width: int) -> None:
        self.batch, self.width = batch, width

    def model(self) -> nn.Module:
        return SmallCNN(self.width)

    def train_batches(self, shard: int, num_shards: int, seed: int, start: int):
        index = start
        while True:
            yield draw(torch.Generator().manual_seed(stream_seed(seed, shard, index)), self.batch)
            index += 1

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def batch_weight(self, batch) -> int:
        return batch[1].numel()  # images

    def eval_batches(self):
        gen = torch.Generator().manual_seed(EVAL_SEED)
        return [draw(gen, EVAL_BATCH) for _ in range(EVAL_BATCHES)]

    def metric(self, model: nn.Module, batch) -> float:
        images, labels = batch
        return float((model(images).argmax(-1) == labels).float().mean())


def workload(args) -> CifarLike:
    known = {"batch": 32, "width": 8}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"unknown options {unknown}; this workload takes {sorted(known)}")
    values = {k: int(args.get(k, v)) for k, v in known.items()}
    if min(values.values()) < 1:
        raise ValueError(f"batch and width must be positive integers, got {values}")
    return CifarLike(**values)
