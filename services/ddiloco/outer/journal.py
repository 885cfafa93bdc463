"""The journals: one file per acknowledged delta, written before the delta is acknowledged,
so an acknowledged delta survives a crash of the outer optimizer; and one file per merge,
written before the merge is applied, so every published version can be rebuilt.

Layout: ``journal/LLLLL-SSSSSSSSSS.delta`` (learner id, sequence) holding a 4-byte header
length, the serialized ``DeltaHeader`` and the payload exactly as received;
``merges/VVVVVVVVVV.json`` (global version) naming the deltas, weights, work fraction and
staleness of the merge that made that version (``MergeJournal``).

Why an unreadable entry stops the restart
-----------------------------------------
Entries are written atomically (temporary file, fsync, rename), so a crash never leaves a
torn entry under its final name: the torn write is a hidden temporary, cleared at start. An
entry that is there but unreadable (bad length, header that does not parse, payload whose
size or digest contradicts its header, name that contradicts its header) is therefore
corruption of an *acknowledged* delta. Skipping it would drop work a learner was told is
safe, so ``load`` raises ``JournalCorrupt`` naming the file, and the outer optimizer refuses
to start (exit non-zero). The one exception: an entry the restored checkpoint already covers
(its delta was merged into the checkpointed parameters) is not needed and not read.
To start anyway, an operator moves the named file out of ``journal/``: the delta is then
lost knowingly, and its learner's next sequence is still accepted.

An entry is not recovered either: its digest covers the payload only, and the payload is the
only copy of the learner's work (the learner dropped its copy once acknowledged), so there
is nothing to rebuild it from; merging a guess would move the model with values no learner
sent. The same holds for an entry that reads but cannot be the delta it was
(``recovery.py`` checks it against the run, as admission did: the header is not digested).

A merge record that is unreadable, skips a version or names a delta the journal lacks
raises ``MergeRecordCorrupt``: the version it made was published, and cannot be rebuilt.

A failed write (disk full, I/O error) raises ``durable.StorageError`` and leaves nothing
behind: the caller refuses the delta with a retryable status and changes no state.
"""

from __future__ import annotations

import json
import pathlib
import re
import struct
from typing import Callable, Iterator

from ddiloco.common import durable
from ddiloco.common.durable import StorageError, seal, seal_holds, write_bytes, write_json
from ddiloco.common.wire import digest_matches, payload_format
from ddiloco.v1 import outer_pb2

_NAME = re.compile(r"^(\d+)-(\d+)\.delta$")
_REFUSAL_NAME = re.compile(r"^(\d+)-(\d+)\.json$")


class JournalCorrupt(Exception):
    """An acknowledged delta's journal entry cannot be read back, or is not a delta of this run."""

    def __init__(self, path: pathlib.Path, reason: str) -> None:
        path = pathlib.Path(path)
        key = parse_name(path)
        self.learner_id, self.seq = key if key is not None else (None, None)
        which = f" (learner {self.learner_id}, sequence {self.seq})" if key is not None else ""
        super().__init__(
            f"journal entry {path}{which} is unreadable ({reason}); it holds an acknowledged delta the checkpoint "
            f"does not cover, so the outer optimizer will not start without it. Restore the file, or move it out of "
            f"{path.parent} to drop that delta knowingly"
        )
        self.path = path
        self.reason = reason


class MergeRecordCorrupt(Exception):
    """A merge record after the checkpoint cannot be replayed: the version it made is lost."""

    def __init__(self, path: pathlib.Path, reason: str) -> None:
        super().__init__(
            f"merge record {path} cannot be replayed ({reason}); the version it made was published, so the outer "
            f"optimizer will not start without it"
        )
        self.path = pathlib.Path(path)
        self.reason = reason


def entry_name(learner_id: int, seq: int) -> str:
    return f"{learner_id:05d}-{seq:010d}.delta"


def parse_name(path: pathlib.Path) -> tuple[int, int] | None:
    """(learner id, sequence) from an entry's file name; None for a name that is not one."""
    m = _NAME.match(pathlib.Path(path).name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def encode_entry(header: outer_pb2.DeltaHeader, payload: bytes) -> bytes:
    head = header.SerializeToString()
    return struct.pack("<I", len(head)) + head + payload


def read_entry(path: pathlib.Path) -> tuple[outer_pb2.DeltaHeader, bytes]:
    """Parse and verify one entry; raises ``JournalCorrupt`` with the reason."""
    path = pathlib.Path(path)
    try:
        # a regular file (a FIFO or a device named like an entry would hang or never end);
        # its size is bounded by the payload limit the entry was admitted under, which a
        # resumed run may have changed: the type is what is checked here
        blob = durable.read_file(path, 1 << 62)
    except OSError as exc:
        raise JournalCorrupt(path, f"cannot read: {exc}") from exc
    if len(blob) < 4:
        raise JournalCorrupt(path, f"{len(blob)} bytes, shorter than the length prefix")
    (n,) = struct.unpack("<I", blob[:4])
    if 4 + n > len(blob):
        raise JournalCorrupt(path, f"header length {n} runs past the end of the {len(blob)}-byte file")
    try:
        header = outer_pb2.DeltaHeader.FromString(blob[4 : 4 + n])
    except Exception as exc:  # protobuf raises DecodeError, but any failure means the same here
        raise JournalCorrupt(path, f"header does not parse: {exc}") from exc
    payload = blob[4 + n :]
    info = header.payload
    if len(payload) != info.payload_bytes:
        raise JournalCorrupt(path, f"payload has {len(payload)} bytes, its header declares {info.payload_bytes}")
    if not digest_matches(info, payload):
        raise JournalCorrupt(path, f"payload digest does not match its header (payload format {payload_format(info)})")
    if parse_name(path) != (header.learner_id, header.seq):
        raise JournalCorrupt(path, f"header says learner {header.learner_id} sequence {header.seq}")
    return header, payload


class DeltaJournal:
    def __init__(self, folder: pathlib.Path, writer: Callable[[pathlib.Path, bytes], None] = write_bytes) -> None:
        self.folder = pathlib.Path(folder)
        self.writer = writer  # injectable: tests make it raise OSError(ENOSPC)

    def path_for(self, learner_id: int, seq: int) -> pathlib.Path:
        return self.folder / entry_name(learner_id, seq)

    def write(self, header: outer_pb2.DeltaHeader, payload: bytes) -> pathlib.Path:
        """Durable before it returns; raises ``StorageError`` (nothing written) on failure."""
        path = self.path_for(header.learner_id, header.seq)
        try:
            self.writer(path, encode_entry(header, payload))
        except OSError as exc:
            # The entry may be in place already (the rename done, the folder's fsync failed).
            # The delta is refused as not journaled, so a restart must not find it and merge
            # it. No other entry can have this name: a sequence is journaled once, under its
            # learner's lock, and only after the checks that refuse a repeat.
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass  # the folder is unusable: the caller's refusal stands, and so may the entry
            if isinstance(exc, StorageError):
                raise
            raise StorageError(path, exc) from exc  # whatever the writer, the caller gets one typed error
        return path

    def discard(self, path: pathlib.Path) -> None:
        """Remove the entry of a delta refused after it was journaled (its process was
        replaced, or the run finalized, while it was written), durably: the folder is fsynced
        after the unlink, or a power cut could bring the entry back for a restart to merge a
        delta that was never acknowledged, whose work the learner's successor trains again.
        Raises ``StorageError`` when the folder cannot be synced."""
        try:
            path.unlink(missing_ok=True)
            durable.fsync_dir(self.folder)
        except OSError as exc:
            raise StorageError(path, exc) from exc

    def load(
        self, covered: Callable[[int, int], bool]
    ) -> dict[tuple[int, int], tuple[pathlib.Path, outer_pb2.DeltaHeader, bytes]]:
        """Every entry the checkpoint does not cover, verified, keyed by (learner, seq).

        ``covered(learner, seq)`` says whether the restored checkpoint already holds that
        delta; covered entries are skipped unread and left for the checkpoint's pruning (the
        older checkpoint kept as a fallback may still need them).
        """
        out = {}
        for path in sorted(self.folder.glob("*.delta")):
            key = parse_name(path)
            if key is not None and covered(*key):
                continue  # merged into the checkpoint: not even read, so damage to it does not matter
            if key is None:
                raise JournalCorrupt(path, "the file name is not LEARNER-SEQUENCE.delta")
            header, payload = read_entry(path)
            out[key] = (path, header, payload)
        return out


def refusal_name(learner_id: int, seq: int) -> str:
    return f"{learner_id:05d}-{seq:010d}.json"


def parse_refusal_name(path: pathlib.Path) -> tuple[int, int] | None:
    """(learner id, sequence) from a stale-refusal record's file name; None for another name."""
    m = _REFUSAL_NAME.match(pathlib.Path(path).name)
    return (int(m.group(1)), int(m.group(2))) if m else None


class RefusalJournal:
    """The stale refusals: one sealed record (learner, sequence, fragment, tokens) per delta
    refused as stale, durable before the refusal is answered.

    A stale refusal is an answer for good: a restarted learner resumes its shard past that
    window (``LearnerRecord.resume_tokens``). The count is kept in memory and in checkpoints;
    without these records a refusal answered after the last checkpoint was forgotten when
    the outer optimizer crashed, and a learner restarting after that trained one window of
    batches again per such refusal. A record that cannot be read back is skipped with an
    error naming it: it costs only that window trained again, never an acknowledged delta,
    so it does not stop the restart as a damaged delta entry does."""

    def __init__(self, folder: pathlib.Path, writer: Callable[[pathlib.Path, dict], None] = write_json) -> None:
        self.folder = pathlib.Path(folder)
        self.writer = writer  # injectable: tests make it raise StorageError(ENOSPC)

    def write(self, learner_id: int, seq: int, fragment: int, tokens: int) -> pathlib.Path:
        """Durable before it returns; raises ``StorageError`` on failure."""
        path = self.folder / refusal_name(learner_id, seq)
        self.writer(path, seal({"learner_id": learner_id, "seq": seq, "fragment": fragment, "tokens": tokens}))
        return path

    def records(self) -> Iterator[tuple[pathlib.Path, dict | None, str]]:
        """Every record, by learner then sequence: (path, record, "") or (path, None, why
        it cannot be used)."""
        for path in sorted(self.folder.glob("*.json")):
            try:
                record = json.loads(durable.read_file(path, durable.MAX_RECORD_BYTES))
                fields = tuple(record[k] for k in ("learner_id", "seq", "fragment", "tokens"))
            except (OSError, ValueError, TypeError, KeyError) as exc:
                yield path, None, f"does not parse: {exc!r}"
                continue
            if seal_holds(record) is not True:
                yield path, None, "does not match its own SHA-256"
            elif not all(isinstance(v, int) and v >= 0 for v in fields) or path.name != refusal_name(*fields[:2]):
                yield path, None, f"its fields {fields} do not match its name"
            else:
                yield path, record, ""


def record_name(version: int) -> str:
    return f"{version:010d}.json"


class MergeJournal:
    """The merge records: which deltas, with which weights and work fraction, made each
    version. Full precision (JSON floats round-trip), so a replay is bit-exact; sealed
    (``durable.seal``), so that a record damaged on disk stops the restart instead of
    replaying a merge that never happened."""

    def __init__(self, folder: pathlib.Path, writer: Callable[[pathlib.Path, dict], None] = write_json) -> None:
        self.folder = pathlib.Path(folder)
        self.writer = writer  # injectable: tests make it raise StorageError(ENOSPC)

    def write(self, record: dict) -> pathlib.Path:
        """Durable before it returns; raises ``StorageError`` (nothing written) on failure."""
        path = self.folder / record_name(record["version"])
        self.writer(path, seal(record))
        return path

    def records(self) -> Iterator[tuple[pathlib.Path, dict]]:
        """Every record, oldest version first; raises ``MergeRecordCorrupt`` for one that
        does not parse."""
        for path in sorted(self.folder.glob("*.json")):
            try:
                record = json.loads(durable.read_file(path, durable.MAX_RECORD_BYTES))
                record["version"], record["fragment"], record["deltas"]  # noqa: B018 -- present
            except (OSError, ValueError, TypeError, KeyError) as exc:
                raise MergeRecordCorrupt(path, f"does not parse: {exc!r}") from exc
            if seal_holds(record) is False:  # None: a record from before records were sealed
                raise MergeRecordCorrupt(path, "does not match its own SHA-256")
            yield path, record
