"""``ddiloco generate``: sample text from the built-in byte-level model of a run or export.

Sampling is plain autoregressive decoding over bytes: temperature, optional top-k, a seed
for repeatability; the context slides over the last ``context`` bytes. Bytes that do not
decode as UTF-8 are shown with replacement characters.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from ddiloco.common.config import DEFAULT_WORKLOAD
from ddiloco.common.model import GPT
from ddiloco.modelio.source import SourceError, load

MAX_NEW = 100_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=pathlib.Path, help="a run folder, a checkpoint folder or an exported file")
    parser.add_argument("--prompt", default="", help="text to continue (default: none)")
    parser.add_argument("--bytes", type=int, default=200, help=f"bytes to generate, 1 to {MAX_NEW:,} (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="> 0; lower is more conservative (default 0.8)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest bytes, 1 to 256 (default 0: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--version", type=int, default=None, help="with a run folder: one of its kept checkpoint versions")


@torch.no_grad()
def sample(model: GPT, prompt: bytes, n: int, temperature: float = 0.8, top_k: int = 0, seed: int = 0) -> bytes:
    """``n`` bytes continuing ``prompt``; the same arguments give the same bytes."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt) or [ord("\n")]
    out = []
    for _ in range(n):
        x = torch.tensor([ids[-model.cfg.context:]], dtype=torch.long)
        logits, _ = model(x)
        logits = logits[0, -1] / temperature
        if 0 < top_k < logits.numel():
            kth = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        ids.append(nxt)
        out.append(nxt)
    return bytes(out)


def main(args: argparse.Namespace) -> int:
    errors = []
    if not 1 <= args.bytes <= MAX_NEW:
        errors.append(f"--bytes must be 1 to {MAX_NEW:,}, got {args.bytes}")
    if not (args.temperature > 0 and args.temperature < float("inf")):
        errors.append(f"--temperature must be a positive number, got {args.temperature}")
    if not 0 <= args.top_k <= 256:
        errors.append(f"--top-k must be 0 to 256, got {args.top_k}")
    if errors:
        print(f"ddiloco generate: error: {errors[0]}", file=sys.stderr)
        return 2
    try:
        source = load(args.source, args.version)
        # sampling bytes is what the built-in workload's model does; another's is not built
        # (its code is not run) to find out that it cannot
        model = source.to_model() if source.workload == DEFAULT_WORKLOAD else None
    except SourceError as exc:
        print(f"ddiloco generate: error: {exc}", file=sys.stderr)
        return 2
    if not isinstance(model, GPT):
        print(f"ddiloco generate: error: {args.source} holds a model of the workload {source.workload!r}; "
              "generate samples the built-in byte-level GPT only", file=sys.stderr)
        return 2
    text = sample(model, args.prompt.encode(), args.bytes, args.temperature, args.top_k, args.seed)
    sys.stdout.write(args.prompt + text.decode("utf-8", errors="replace") + "\n")
    return 0
