"""Which torch device a training process uses (``--device auto|cpu|cuda``)."""

from __future__ import annotations

import torch


def pick_device(name: str) -> torch.device:
    """``auto``: CUDA when present, else the CPU; ``cuda`` without a GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    return torch.device(name)
