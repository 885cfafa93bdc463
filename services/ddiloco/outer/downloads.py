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

A pull from the version the learner already holds, once its copy of it can get no closer,
is answered "no change" (a payload of zeros, based on that version) and leaves the view as it
is. Its copy is that close when it came in full, is version 0 named by digest, or is the
copy one such second download left: a change from a version to itself carries what the
quantizer lost once, and after it the copy is as close as any later one. Before this, every
repeated pull from the current version minted a new copy and a new shared answer (keyed by
the copy it started from), so one learner asking again and again grew this process by two
fragment copies a call until the fragment moved (600 pulls of the tiny model: 330 to 732
MiB). Now a learner's view of a version changes at most twice (the download to it and the
refinement), and what is remembered per version is bounded by the learners' views.

Bounded: every remembered copy is a full fragment, so views are kept for at most
``max_learners`` learners, least recently pulled first out. The service only asks for
learners the coordinator registered, and sizes the bound as the planned learners plus a
margin for replacements; a learner whose view was evicted simply gets the full fragment
on its next pull, as after a rejoin.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ddiloco.common import codec


@dataclass
class FragmentView:
    """One learner's remembered copies of one fragment, by version: the latest and the one
    before it (a lost download is asked again from it). ``settled``: the version whose copy a
    further pull of the same version cannot improve (the module docstring), None while the
    latest copy is a first quantized change."""

    copies: dict[int, list[np.ndarray]]
    settled: int | None = None


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
        # learner -> fragment -> its view; order is recency of the learner's last pull
        self._views: OrderedDict[int, dict[int, FragmentView]] = OrderedDict()
        self.evicted = 0
        self.initial = initial
        # fragment -> held_digest of its version 0: every learner that joins names the same
        # copy, so it is hashed once, not once per learner
        self._digests: dict[int, bytes] = {}
        # fragment -> (version, {key of the learner's copy: (that copy, answer, copy after
        # it)}): the answers to pulls of the fragment's latest version, shared by
        # learners holding the same copy (the key is the copy's id, kept alive by the entry,
        # so it cannot be reused while the entry lives; "initial" for version 0, "full",
        # "zeros" and "unchanged" for the answers that do not depend on a copy)
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

    def _fragments_of(self, learner_id: int) -> dict[int, FragmentView]:
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
            view = views.get(fragment)
            if have_digest:
                v0 = self.initial(fragment)
                base = v0 if have_version == 0 and self._digest(fragment, v0) == have_digest else None
                key = "initial"  # a new list of the same arrays at every call: named, not by id
                if base is not None and version == 0:
                    # nothing changed since the learner's copy: a change of zeros, compressed to
                    # next to nothing whatever the codec
                    held, enc, _ = self._answer(fragment, version, "zeros", base, lambda: (self._zeros(arrays), base))
                    # one list for every learner: shared later too
                    views[fragment] = FragmentView({version: held}, settled=version)
                    return enc, version
            else:
                if view is not None and have_version == version == view.settled:
                    # its copy of the current version is as close as it gets: nothing is new, and
                    # the view stays as it is (no copy minted per call: the module docstring)
                    _, enc, _ = self._answer(fragment, version, "unchanged", None, lambda: (self._zeros(arrays), None))
                    return enc, version
                base = view.copies.get(have_version) if view is not None and have_version >= 0 else None
                key = id(base)
            if base is None or self.codec == "fp32":
                _, enc, copy = self._answer(fragment, version, "full", None, lambda: (
                    codec.encode(arrays, "fp32"), [a.copy() for _, a in arrays]))
                views[fragment] = FragmentView({version: copy}, settled=version)  # exact
                return enc, -1
            held, enc, new_copy = self._answer(fragment, version, key, base, lambda: self._change(arrays, base))
            # keep the learner's current copy too: if this download is lost, it asks again from it.
            # A change from the version itself is the refinement: after it, nothing more is new
            views[fragment] = FragmentView(
                {have_version: held, version: new_copy}, settled=version if have_version == version else None,
            )
            return enc, have_version

    def _zeros(self, arrays: list[tuple[str, np.ndarray]]) -> codec.Encoded:
        """A change of nothing, compressed to next to nothing whatever the codec."""
        return codec.encode([(n, np.zeros_like(a)) for n, a in arrays], self.codec, self.block_size, compression="zstd")

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
