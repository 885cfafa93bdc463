"""Broken uploads, kept so that the learner resumes instead of sending everything again.

When a PushDelta stream breaks (the connection drops, the learner's deadline passes), the
bytes received so far are kept here under the upload's header. The learner's retry asks
``UploadOffset`` with the same header, gets the number of bytes held, and streams the
rest with ``DeltaHeader.offset`` set to it; the service joins the two and checks the
whole payload (size, digest, everything) as for any other upload. Nothing held is ever
acknowledged: it is a cache, and a retry from offset 0 is always correct.

Bounded: one broken upload per learner id (a newer one replaces it), at most
``max_learners`` learners (least recent first out), each dropped after ``ttl_s``. A
partial never exceeds its header's declared size, which reassembly bounded by the run's
delta limit, so this holds no more than the uploads in flight did when they broke. The
service keeps only uploads of its own run from learners the coordinator registered.

Every call drops every expired upload, not only the one it looks up: a learner that never
comes back (it died, or was replaced under a new id) would otherwise keep its bytes until
enough other learners' uploads broke to push it out, up to ``max_learners`` times the delta
limit held for nothing. Entries are in the order they were kept, so the sweep reads only
the expired ones and the first that is not.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

from ddiloco.v1 import outer_pb2


def upload_key(header: outer_pb2.DeltaHeader) -> bytes:
    """What identifies an upload: its whole header except the offset."""
    h = outer_pb2.DeltaHeader()
    h.CopyFrom(header)
    h.offset = 0
    h.more_queued = False  # advisory and set per attempt: a retry's may differ
    return h.SerializeToString(deterministic=True)


class PartialUploads:
    def __init__(self, max_learners: int, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        if max_learners < 1:
            raise ValueError(f"max_learners must be at least 1, got {max_learners}")
        self.max_learners = max_learners
        self.ttl_s = ttl_s
        self.clock = clock
        # learner -> (key, data, kept at), in the order kept (keep moves an entry to the end)
        self._held: OrderedDict[int, tuple[bytes, bytes, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Learners with an upload held now (expired ones until the next call drops them)."""
        with self._lock:
            return len(self._held)

    def keep(self, header: outer_pb2.DeltaHeader, data: bytes) -> None:
        if not data:
            return
        with self._lock:
            self._expire()
            self._held.pop(header.learner_id, None)
            self._held[header.learner_id] = (upload_key(header), data, self.clock())
            while len(self._held) > self.max_learners:
                self._held.popitem(last=False)

    def _expire(self) -> None:
        """Drop every upload kept more than ``ttl_s`` ago (oldest first: the order kept)."""
        now = self.clock()
        while self._held:
            _, _, kept_at = next(iter(self._held.values()))
            if now - kept_at <= self.ttl_s:
                return
            self._held.popitem(last=False)

    def _entry(self, header: outer_pb2.DeltaHeader) -> bytes | None:
        self._expire()
        entry = self._held.get(header.learner_id)
        if entry is None:
            return None
        key, data, _ = entry
        return data if key == upload_key(header) else None

    def held(self, header: outer_pb2.DeltaHeader) -> int:
        """Bytes held for exactly this upload (0: none)."""
        with self._lock:
            data = self._entry(header)
            return 0 if data is None else len(data)

    def take(self, header: outer_pb2.DeltaHeader) -> bytes | None:
        """The bytes held for this upload, removed from here, if they are exactly
        ``header.offset`` bytes; else None (and whatever was held stays)."""
        with self._lock:
            data = self._entry(header)
            if data is None or len(data) != header.offset:
                return None
            del self._held[header.learner_id]
            return data
