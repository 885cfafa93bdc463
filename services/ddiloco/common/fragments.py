"""Fragments (Streaming DiLoCo): the parameters split into P groups of whole tensors,
each synced on its own staggered schedule, so only about 1/P of the model is in flight at
any moment and peak bandwidth drops by about P.

Partition: balanced bin-packing, largest tensor first into the lightest fragment. It is
deterministic (ties broken by tensor order), so every process derives the same partition
from the model alone.

Schedule: each fragment syncs every H inner steps; fragment p's first window ends after
``offset(p) = round((p + 1) * H / P)`` steps, so the fragments are evenly staggered across
the window (the last fragment ends on multiples of H, like P = 1). A learner that changes
its H (dynamic local updates) keeps the stagger: each fragment's next window simply ends H
steps after its last.

Outer shards: with S outer-optimizer shards, fragment f belongs to shard ``f % S``
(``shard_of``). The partition already balances the fragments by size, so dealing them out
round-robin balances the shards too whenever S divides P (within one fragment otherwise);
the map is a pure function of (P, S), so every process derives it from the run
configuration without asking anyone.
"""

from __future__ import annotations

from typing import Sequence


def partition(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of tensors per fragment, each list in model order."""
    if parts < 1:
        raise ValueError(f"need at least one fragment, got {parts}")
    if parts > len(sizes):
        raise ValueError(f"{parts} fragments for {len(sizes)} tensors: each fragment needs a tensor")
    loads = [0] * parts
    members: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        p = min(range(parts), key=lambda p: (loads[p], p))
        loads[p] += sizes[i]
        members[p].append(i)
    return [sorted(m) for m in members]


def offset(fragment: int, parts: int, inner_steps: int) -> int:
    """Length of fragment ``fragment``'s first window, in inner steps."""
    return max(1, round((fragment + 1) * inner_steps / parts))


def shard_of(fragment: int, shards: int) -> int:
    """The outer shard that owns ``fragment``."""
    if shards < 1:
        raise ValueError(f"need at least one outer shard, got {shards}")
    return fragment % shards


def shard_fragments(shard: int, shards: int, fragments: int) -> list[int]:
    """The fragments outer shard ``shard`` of ``shards`` owns, in order."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} does not exist; the run has {shards}")
    if shards > fragments:
        raise ValueError(f"{shards} outer shards for {fragments} fragments: each shard needs a fragment")
    return list(range(shard, fragments, shards))
