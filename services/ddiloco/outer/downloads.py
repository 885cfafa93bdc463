"""What each learner downloads: only the change since its copy, quantized like uploads.

For every (learner, fragment) the outer optimizer remembers the copy of the global
parameters that learner holds, exactly as the learner reconstructed it (the decode is
deterministic). A pull from version ``v`` sends ``global - copy[v]`` through the lossy
codec and advances the remembered copy by what was actually sent. The quantization error of
one download is thus corrected by the next one instead of accumulating: the learner's copy
stays within one round of quantization error of the true global parameters.

The full fragment (fp32) goes out only when a learner joins, rejoins, or asks from a
version this side no longer holds. A learner that joins while a fragment is still at the
version it built itself (the run's seeded initial model, before that fragment's first
merge) names its copy by digest instead (``have_digest``): if it is exactly the current
version, that copy becomes the learner's view and the answer is the change since it, which
is nothing; the whole model is not sent over the WAN to every datacenter at the start of a
run that each can build itself. The copy before the latest download is kept as well, so
a download lost in transit (the learner asks again from its older version) costs nothing.

Bounded: every remembered copy is a full fragment, so views are kept for at most
``max_learners`` learners, least recently pulled first out. The service only asks for
learners the coordinator registered, and sizes the bound as the planned learners plus a
margin for replacements; a learner whose view was evicted simply gets the full fragment
on its next pull, as after a rejoin.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ddiloco.common import codec


class DownloadViews:
    def __init__(self, codec_name: str, block_size: int, max_learners: int) -> None:
        if max_learners < 1:
            raise ValueError(f"max_learners must be at least 1, got {max_learners}")
        self.codec = codec_name
        self.block_size = block_size
        self.max_learners = max_learners
        # learner -> fragment -> {version: copy}; order is recency of the learner's last pull
        self._views: OrderedDict[int, dict[int, dict[int, list[np.ndarray]]]] = OrderedDict()
        self.evicted = 0
        # fragment -> (version, held_digest of it): every learner that joins names the same
        # copy, so a fragment is hashed once per version, not once per learner
        self._digests: dict[int, tuple[int, bytes]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Learners with a view held."""
        with self._lock:
            return len(self._views)

    def forget(self, learner_id: int) -> None:
        with self._lock:
            self._views.pop(learner_id, None)

    def _fragments_of(self, learner_id: int) -> dict[int, dict[int, list[np.ndarray]]]:
        views = self._views.get(learner_id)
        if views is None:
            views = self._views[learner_id] = {}
            while len(self._views) > self.max_learners:
                self._views.popitem(last=False)
                self.evicted += 1
        self._views.move_to_end(learner_id)
        return views

    def _digest(self, fragment: int, version: int, held: list[np.ndarray]) -> bytes:
        cached = self._digests.get(fragment)
        if cached is None or cached[0] != version:
            cached = self._digests[fragment] = (version, codec.held_digest(held))
        return cached[1]

    def encode_for(
        self, learner_id: int, fragment: int, have_version: int, version: int, arrays: list[tuple[str, np.ndarray]],
        have_digest: bytes = b"",
    ) -> tuple[codec.Encoded, int]:
        """Returns (payload, base_version): base -1 means a full fp32 fragment. ``have_digest``:
        the learner's own copy, claimed to be ``have_version`` (the module docstring); its
        claim is checked against the current version only (a digest of it), and ignored
        (the full fragment) if it is not that.

        The encode runs under the lock, so the learners pulling after a merge are encoded
        one at a time. Encoding outside it was tried and measured slower on two cores
        (``bench/outer_throughput.py``, two alternating runs each: outer CPU per delta up by
        20-50%, deltas per second down): sixteen threads then contend for the interpreter lock
        instead of taking turns."""
        with self._lock:
            views = self._fragments_of(learner_id)
            if have_digest:
                held = [a for _, a in arrays]
                if have_version != version or self._digest(fragment, version, held) != have_digest:
                    base = None
                else:
                    base = [a.copy() for a in held]
                    views[fragment] = {version: base}
                    # nothing changed since the learner's copy: a change of zeros, compressed to
                    # next to nothing whatever the codec
                    zeros = [(n, np.zeros_like(a)) for n, a in arrays]
                    return codec.encode(zeros, self.codec, self.block_size, compression="zstd"), version
            else:
                copies = views.get(fragment, {})
                base = copies.get(have_version) if have_version >= 0 else None
            if base is None or self.codec == "fp32":
                enc = codec.encode(arrays, "fp32")
                views[fragment] = {version: [a.copy() for _, a in arrays]}
                return enc, -1
            diff = [(n, a - b) for (n, a), b in zip(arrays, base)]
            # what the learner will decode, from the quantizer itself: no decode of our own payload
            enc, sent = codec.encode_with_sent(diff, self.codec, self.block_size)
            new_copy = [b + d for b, d in zip(base, sent)]
            # keep the learner's current copy too: if this download is lost, it asks again from it
            views[fragment] = {have_version: base, version: new_copy}
            return enc, have_version
