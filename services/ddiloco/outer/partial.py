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
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from ddiloco.v1 import outer_pb2


def upload_key(header: outer_pb2.DeltaHeader) -> bytes:
    """What identifies an upload: its whole header except the offset."""
    h = outer_pb2.DeltaHeader()
    h.CopyFrom(header)
    h.offset = 0
    h.more_queued = False  # advisory and set per attempt: a retry's may differ
    return h.SerializeToString(deterministic=True)


class PartialUploads:
    def __init__(self, max_learners: int, ttl_s: float = 600.0) -> None:
        if max_learners < 1:
            raise ValueError(f"max_learners must be at least 1, got {max_learners}")
        self.max_learners = max_learners
        self.ttl_s = ttl_s
        self._held: OrderedDict[int, tuple[bytes, bytes, float]] = OrderedDict()  # learner -> (key, data, kept at)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def keep(self, header: outer_pb2.DeltaHeader, data: bytes) -> None:
        if not data:
            return
        with self._lock:
            self._held.pop(header.learner_id, None)
            self._held[header.learner_id] = (upload_key(header), data, time.monotonic())
            while len(self._held) > self.max_learners:
                self._held.popitem(last=False)

    def _entry(self, header: outer_pb2.DeltaHeader) -> bytes | None:
        entry = self._held.get(header.learner_id)
        if entry is None:
            return None
        key, data, kept_at = entry
        if time.monotonic() - kept_at > self.ttl_s:
            del self._held[header.learner_id]
            return None
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
