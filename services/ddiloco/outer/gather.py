"""The global model on a sharded outer optimizer, for evaluation.

Outer shard 0 evaluates (``outer/evaluator.py``): its own fragments come from its state,
every other fragment is read from the shard that owns it (``ReadFragment``: a full fp32
copy, outer role only). Each read copies one fragment under its shard's lock for a moment,
so evaluating never holds up a merge for longer than a snapshot does; a shard that cannot be
reached makes this evaluation fail (``errors.Unavailable``) and the next one try again.

The version of the gathered model is the sum of its fragments' versions: every merge adds
one to exactly one fragment, so this is the count of merges across shards, the version an
unsharded run reports for the same merges.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

import grpc
import numpy as np

from ddiloco.common import errors
from ddiloco.common.fragments import shard_of
from ddiloco.common.rpc import channel
from ddiloco.common.wire import OUTER_SERVICE, chunk_parser, decode_payload, reassemble
from ddiloco.v1 import outer_pb2

if TYPE_CHECKING:
    from ddiloco.outer.state import OuterState

READ_TIMEOUT_S = 60.0
MAX_FRAGMENT_BYTES = 1 << 38  # a fragment read is fp32: 256 GiB bounds any model this runs


class FragmentGather:
    def __init__(self, state: "OuterState", addresses: Callable[[], list[str]], security=None) -> None:
        """``addresses()``: every shard's address by index, as the coordinator last said."""
        self.state = state
        self.addresses = addresses
        self.security = security
        self.parts = state.parts  # every fragment's tensors, as the state partitioned them
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    def _read_method(self, address: str):
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channel(address, self.security, server_role="outer")
        return ch.unary_stream(
            f"/{OUTER_SERVICE}/ReadFragment",
            request_serializer=outer_pb2.ReadFragmentRequest.SerializeToString,
            response_deserializer=chunk_parser(outer_pb2.GlobalChunk),
        )

    def read(self, fragment: int) -> tuple[int, int, list[tuple[str, np.ndarray]]]:
        """(version, tokens merged, arrays) of a fragment another shard owns."""
        cfg = self.state.config
        shard = shard_of(fragment, cfg.outer_shards)
        addresses = self.addresses()
        address = addresses[shard] if shard < len(addresses) else ""
        if not address:
            raise errors.Unavailable(f"outer shard {shard} (fragment {fragment}) has not registered")
        try:
            stream = self._read_method(address)(
                outer_pb2.ReadFragmentRequest(run_id=cfg.run_id, fragment=fragment), timeout=READ_TIMEOUT_S
            )
            header, payload = reassemble(stream, MAX_FRAGMENT_BYTES, "fragment")
            arrays = decode_payload(header.payload, payload)
        except grpc.RpcError as exc:
            raise errors.Unavailable(f"outer shard {shard} at {address}: fragment {fragment}: {exc.code().name}") from exc
        if header.fragment != fragment:
            raise errors.Unavailable(f"outer shard {shard} answered fragment {header.fragment} for {fragment}")
        want = [self.state.names[i] for i in self.parts[fragment]]
        if [n for n, _ in arrays] != want:
            raise errors.Unavailable(f"outer shard {shard}: fragment {fragment} holds other tensors than this model's")
        return header.version, header.tokens_merged, arrays

    def model(self) -> tuple[int, int, list[tuple[str, np.ndarray]]]:
        """(version, tokens merged, named arrays in model order) of the global model."""
        state = self.state
        arrays: list[tuple[str, np.ndarray] | None] = [None] * len(state.names)
        version, tokens = 0, None
        for f in range(state.config.fragments):
            v, t, got = state.snapshot(f) if f in state.by_index else self.read(f)
            version += v
            tokens = t if tokens is None else min(tokens, t)
            for i, named in zip(self.parts[f], got):
                arrays[i] = named
        assert all(a is not None for a in arrays)
        return version, tokens or 0, arrays  # type: ignore[return-value]
