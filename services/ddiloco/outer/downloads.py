"""What each learner downloads: only the change since its copy, quantized like uploads.

For every (learner, fragment) the outer optimizer remembers the copy of the global
parameters that learner holds, exactly as the learner reconstructed it (the decode is
deterministic). A pull from version ``v`` sends ``global - copy[v]`` through the lossy
codec and advances the remembered copy by what was actually sent. The quantization error of
one download is thus corrected by the next one instead of accumulating: the learner's copy
stays within one round of quantization error of the true global parameters.

The full fragment (fp32) goes out only when a learner joins, rejoins, or asks from a
version this side no longer holds. The copy before the latest download is kept as well, so
a download lost in transit (the learner asks again from its older version) costs nothing.
"""

from __future__ import annotations

import threading

import numpy as np

from ddiloco.common import codec


class DownloadViews:
    def __init__(self, codec_name: str, block_size: int) -> None:
        self.codec = codec_name
        self.block_size = block_size
        self._copies: dict[tuple[int, int], dict[int, list[np.ndarray]]] = {}
        self._lock = threading.Lock()

    def forget(self, learner_id: int) -> None:
        with self._lock:
            for key in [k for k in self._copies if k[0] == learner_id]:
                del self._copies[key]

    def encode_for(
        self, learner_id: int, fragment: int, have_version: int, version: int, arrays: list[tuple[str, np.ndarray]]
    ) -> tuple[codec.Encoded, int]:
        """Returns (payload, base_version): base -1 means a full fp32 fragment."""
        key = (learner_id, fragment)
        with self._lock:
            copies = self._copies.get(key, {})
            base = copies.get(have_version) if have_version >= 0 else None
            if base is None or self.codec == "fp32":
                enc = codec.encode(arrays, "fp32")
                self._copies[key] = {version: [a.copy() for _, a in arrays]}
                return enc, -1
            diff = [(n, a - b) for (n, a), b in zip(arrays, base)]
            enc = codec.encode(diff, self.codec, self.block_size)
            sent = codec.decode(enc.payload, enc.codec, enc.block_size, enc.specs, enc.sha256)
            new_copy = [b + d for b, (_, d) in zip(base, sent)]
            # keep the learner's current copy too: if this download is lost, it asks again from it
            self._copies[key] = {have_version: base, version: new_copy}
            return enc, have_version
