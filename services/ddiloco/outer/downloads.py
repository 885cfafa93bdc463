"""What each learner downloads: only the change since its copy, quantized like uploads.

For every (learner, fragment) the outer optimizer remembers the copy of the global
parameters that learner holds, exactly as the learner reconstructed it (the decode is
deterministic). A pull from version ``v`` sends ``global - copy[v]`` through the lossy
codec and advances the remembered copy by what was actually sent. The quantization error of
one download is thus corrected by the next one instead of accumulating: the learner's copy
stays within one round of quantization error of the true global parameters.

The full fragment (fp32) goes out only when a learner joins or rejoins with a copy this
side does not know, or asks from a version this side no longer holds. A learner that joins
holding the model it built itself (the run's seeded initial model: version 0) names that copy
by digest (``have_digest``). This side keeps each fragment's version 0 for the whole run
(``initial``, one more copy of the fragments beside the global ones), so such a copy becomes
the learner's view whatever version the fragment has reached since, and the answer is the
change since it, quantized like any download: nothing while the fragment is still at version
0, else every merge so far in one change. The whole model is thus never sent over the WAN to
a datacenter that can build it itself: not at the start of a run, not to a learner that
starts after the first merges (a quorum of half the learners merges before the others are
up), not to one that restarts. The learner asks once more at once after such a change
(``learner/puller.py``): a change that spans many merges is large, and the second download,
from the copy the first one left, carries what the quantizer lost. The copy before the
latest download is kept as well, so a download lost in transit (the learner asks again from
its older version) costs nothing.

Learners whose remembered copies are the same object (they started from the same copy and
pulled the same versions since: in synchronous DiLoCo every learner, every round;
asynchronous learners until their pulls first differ, after which their copies never
coincide again) get the same answer to a pull of the same version: it is encoded once, and the
copy it leaves is one object remembered for each of them. The answer is a deterministic
function of the copy and the version, so sharing it changes no byte; it saves the encode
(one per pull before: 16 learners pulling after a merge cost 16) and the memory of identical
copies.

Bounded: every remembered copy is a full fragment, so views are kept for at most
``max_learners`` learners, least recently pulled first out. The service only asks for
learners the coordinator registered, and sizes the bound as the planned learners plus a
margin for replacements; a learner whose view was evicted simply gets the full fragment
on its next pull, as after a rejoin.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import numpy as np

from ddiloco.common import codec


class DownloadViews:
    def __init__(
        self, codec_name: str, block_size: int, max_learners: int, initial: Callable[[int], list[np.ndarray]],
    ) -> None:
        """``initial(fragment)``: that fragment's version 0, never written to (a learner's view
        may share it)."""
        if max_learners < 1:
            raise ValueError(f"max_learners must be at least 1, got {max_learners}")
        self.codec = codec_name
        self.block_size = block_size
        self.max_learners = max_learners
        # learner -> fragment -> {version: copy}; order is recency of the learner's last pull
        self._views: OrderedDict[int, dict[int, dict[int, list[np.ndarray]]]] = OrderedDict()
        self.evicted = 0
        self.initial = initial
        # fragment -> held_digest of its version 0: every learner that joins names the same
        # copy, so it is hashed once, not once per learner
        self._digests: dict[int, bytes] = {}
        # fragment -> (version, {key of the learner's copy: (that copy, answer, copy after
        # it)}): the answers to pulls of the fragment's latest version, shared by
        # learners holding the same copy (the key is the copy's id, kept alive by the entry,
        # so it cannot be reused while the entry lives; "initial" for version 0, "full" and
        # "zeros" for the answers that do not depend on a copy)
        self._answers: dict[int, tuple[int, dict]] = {}
        self.served = 0  # pulls answered
        self.encodes = 0  # answers encoded: what the sharing saved is served - encodes
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

    def _digest(self, fragment: int, copy: list[np.ndarray]) -> bytes:
        if fragment not in self._digests:
            self._digests[fragment] = codec.held_digest(copy)
        return self._digests[fragment]

    def encode_for(
        self, learner_id: int, fragment: int, have_version: int, version: int, arrays: list[tuple[str, np.ndarray]],
        have_digest: bytes = b"",
    ) -> tuple[codec.Encoded, int]:
        """Returns (payload, base_version): base -1 means a full fp32 fragment. ``have_digest``:
        the learner's own copy, claimed to be ``have_version`` (the module docstring); the
        claim holds only for version 0, checked by a digest of it, and is ignored (the full
        fragment) otherwise.

        The encode runs under the lock, so the learners pulling after a merge are encoded
        one at a time. Encoding outside it was tried and measured slower on two cores
        (``bench/outer_throughput.py``, two alternating runs each: outer CPU per delta up by
        20-50%, deltas per second down): sixteen threads then contend for the interpreter lock
        instead of taking turns."""
        with self._lock:
            self.served += 1
            views = self._fragments_of(learner_id)
            if have_digest:
                v0 = self.initial(fragment)
                base = v0 if have_version == 0 and self._digest(fragment, v0) == have_digest else None
                key = "initial"  # a new list of the same arrays at every call: named, not by id
                if base is not None and version == 0:
                    # nothing changed since the learner's copy: a change of zeros, compressed to
                    # next to nothing whatever the codec
                    held, enc, _ = self._answer(fragment, version, "zeros", base, lambda: (
                        codec.encode([(n, np.zeros_like(a)) for n, a in arrays], self.codec, self.block_size,
                                     compression="zstd"), base))
                    views[fragment] = {version: held}  # one list for every learner: shared later too
                    return enc, version
            else:
                copies = views.get(fragment, {})
                base = copies.get(have_version) if have_version >= 0 else None
                key = id(base)
            if base is None or self.codec == "fp32":
                _, enc, copy = self._answer(fragment, version, "full", None, lambda: (
                    codec.encode(arrays, "fp32"), [a.copy() for _, a in arrays]))
                views[fragment] = {version: copy}
                return enc, -1
            held, enc, new_copy = self._answer(fragment, version, key, base, lambda: self._change(arrays, base))
            # keep the learner's current copy too: if this download is lost, it asks again from it
            views[fragment] = {have_version: held, version: new_copy}
            return enc, have_version

    def _change(self, arrays: list[tuple[str, np.ndarray]], base: list[np.ndarray]) -> tuple[codec.Encoded, list]:
        """The change from ``base`` to ``arrays`` through the run's codec, and the copy the
        learner will hold after decoding it."""
        diff = [(n, a - b) for (n, a), b in zip(arrays, base)]
        # what the learner will decode, from the quantizer itself: no decode of our own payload
        enc, sent = codec.encode_with_sent(diff, self.codec, self.block_size)
        return enc, [b + d for b, d in zip(base, sent)]

    def _answer(self, fragment: int, version: int, key, base, make: Callable[[], tuple]) -> tuple:
        """``(copy, answer, copy after it)``: the shared answer to a pull of ``version`` from
        the copy ``key`` names, made by ``make`` (answer and copy after it) if no learner
        holding that copy asked it yet.
        Only one version's answers are kept per fragment, the one last asked for: pulls
        follow the fragment's latest version, and a late pull of an older one (a thread
        that read the parameters just before a merge) is merely encoded again."""
        held_version, answers = self._answers.get(fragment, (None, None))
        if held_version != version:
            answers = {}
            self._answers[fragment] = (version, answers)
        if key not in answers:
            answers[key] = (base,) + tuple(make())
            self.encodes += 1
        return answers[key]
