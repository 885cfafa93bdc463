"""Checkpoints of the outer optimizer, replaced atomically and restored from the newest
complete one.

Layout under ``<state dir>/checkpoints/``::

    vVVVVVVVV-gGGGGGG/global.safetensors   parameters and momentum
    vVVVVVVVV-gGGGGGG/state.json           versions, learners, pending deltas, and the
                                           SHA-256 of global.safetensors
    LATEST                                 the name of the newest checkpoint

``V`` is the global version, ``G`` a generation that only grows: every write goes to a new
name, so re-checkpointing a version never touches the folder ``LATEST`` names.

Write sequence, each step durable before the next:

1. both files into a hidden ``.vV-gG.tmp`` folder, each fsynced, then the folder fsynced;
2. the folder renamed to its final, new name, and ``checkpoints/`` fsynced;
3. ``LATEST`` replaced atomically (``durable.write_bytes``);
4. only then, deletion of what is no longer needed (``_prune``).

A crash before 3 leaves ``LATEST`` naming the previous checkpoint, whose journal and merge
records are all still there; after 3 the new one is complete. Either way restore finds a
complete checkpoint and the records to bring it to the same version, bit for bit.

What is kept
------------
The new checkpoint *and the previous complete one*, with the merge records and journal
entries the previous one needs. Should the newest ever be unreadable (a disk that lost
data), restore falls back to the previous one and replays the records to the same state;
only records the previous checkpoint already covers are deleted. Restore never silently
goes back in versions: the caller compares with the version ``LATEST`` names.

Complete means: both files present, ``state.json`` parses and matches its own SHA-256
(``durable.seal``), has the fields restore reads with their types and ranges
(``check_state``), its version matches the folder name, the tensors file has the SHA-256
``state.json`` records and parses. The seal is a plain SHA-256: it catches damage, not a
crafted or version-skewed file, which is why the fields are checked as well.

Re-checkpointing unchanged state (same version, same learners and pending deltas, which is
all that distinguishes two checkpoints) is a no-op: nothing is written or deleted.

A failed write raises ``durable.StorageError`` (path and errno) and leaves no temporary
behind; a crash may leave one, which ``clean_temporaries`` removes at the next start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ddiloco.common.durable import (
    MAX_NAME_BYTES,
    MAX_RECORD_BYTES,
    SEAL,
    TMP_MARK,
    StorageError,
    fsync_dir,
    read_file,
    remove_temporaries,
    seal,
    seal_holds,
    write_bytes,
    write_json,
)
from ddiloco.outer.journal import parse_name, parse_refusal_name

log = logging.getLogger(__name__)

TENSORS = "global.safetensors"
STATE = "state.json"
LATEST = "LATEST"
_FOLDER = re.compile(r"^v(\d+)(?:-g(\d+))?$")  # "v00000008" is the layout before generations
_UNKEYED = ("written_at", "tensors_sha256", "tensors_bytes", SEAL)  # fields that differ between two writes of the same state


class CheckpointError(Exception):
    """No checkpoint can be restored although some exist (corruption, not a crash)."""


class Incomplete(Exception):
    """One checkpoint folder is missing a file, or a file does not check out."""


@dataclass
class Loaded:
    path: pathlib.Path
    tensors: dict[str, torch.Tensor]
    state: dict
    skipped: list[str] = field(default_factory=list)  # newer folders that were not complete, and why
    latest_version: int | None = None  # the version LATEST names, complete or not


def latest_name(root: pathlib.Path) -> str | None:
    """The checkpoint folder ``root/LATEST`` names (None: no LATEST). ``CheckpointError``
    unless it is a checkpoint folder's bare name: LATEST is this folder's own, and a path
    (``../other-run/v00000005``, ``/tmp/x``) would have a restore or an export read, and
    trust, a checkpoint from anywhere."""
    path = pathlib.Path(root) / LATEST
    if not path.exists():
        return None
    try:
        name = read_file(path, MAX_NAME_BYTES).decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    if not _FOLDER.match(name):
        raise CheckpointError(f"{path}: names {name[:100]!r}, which is not a checkpoint folder of {root} (vVERSION-gGENERATION)")
    return name


def folder_key(path: pathlib.Path) -> tuple[int, int] | None:
    """(version, generation) of a checkpoint folder name; None for other names."""
    m = _FOLDER.match(path.name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def state_key(state: dict) -> str:
    """What makes two checkpoints different: everything but the write time and the hash."""
    kept = {k: v for k, v in state.items() if k not in _UNKEYED}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


@contextmanager
def _storage(path: pathlib.Path):
    """Any OSError from the block becomes a StorageError naming ``path``."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise StorageError(path, exc) from exc


def _write_file(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------ state.json's fields
# Every integer restore reads (versions, sequences, counters, token counts, learner ids and
# fragment indices) is a JSON integer in [0, MAX_INT]: they go out in int64 protobuf fields
# (a version of 2**70 was restored, then every reply to a learner's push failed), and they
# only grow by small steps, so 2**62 leaves room for the run to go on.
MAX_INT = 2**62
_DECIMAL = re.compile(r"[0-9]{1,19}")  # the keys of int-keyed maps: what str(int) wrote
# the fields of a learner's record (records.LearnerRecord, which takes exactly these):
# counters, and per-fragment token maps
LEARNER_INTS = ("last_seq_accepted", "last_seq_applied", "accepted", "merged", "refused", "last_seq_refused_stale")
LEARNER_MAPS = ("tokens_merged", "tokens_accepted", "tokens_refused_stale")
LEARNER_REQUIRED = ("last_seq_accepted",)  # prune_covered indexes it; the others default to 0 / {}
FRAGMENT_INTS = ("version", "tokens_merged")
FRAGMENT_MAPS = ("tokens_at_version", "merged_by_learner")  # plus own_at_version, a map of maps


class BadState(ValueError):
    """A field of ``state.json`` that restore cannot use: the message says which and why."""


def _show(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _int(value: object, where: str) -> int:
    # ``type is int``: a bool is an int to Python, and 47.0 compares equal to 47 (a float
    # version passed the folder-name check and was restored as 47.0)
    if type(value) is not int:
        raise BadState(f"{where} is {_show(value)}, not an integer")
    if not 0 <= value <= MAX_INT:
        raise BadState(f"{where} is {value}, outside [0, 2**62]")
    return value


def _typed(value, kind: type, noun: str, where: str):
    if not isinstance(value, kind):
        raise BadState(f"{where} is {_show(value)}, not {noun}")
    return value


def _str(value: object, where: str) -> str:
    return _typed(value, str, "a string", where)


def _obj(value: object, where: str) -> dict:
    return _typed(value, dict, "an object", where)


def _list(value: object, where: str) -> list:
    return _typed(value, list, "a list", where)


def _field(obj: dict, key: str, where: str) -> object:
    """``obj[key]``; ``where``: the path of ``obj`` in the file ("" for the file itself)."""
    if key not in obj:
        raise BadState(f"{where} has no {key}" if where else f"no {key}")
    return obj[key]


def _int_map(value: object, where: str, check_value: Callable[[object, str], object] = _int) -> dict:
    """An object whose keys are str(int) (JSON keys are strings) and whose values pass
    ``check_value``: what ``{int(k): v ...}`` in records.py reads back."""
    for k, v in _obj(value, where).items():
        if not (_DECIMAL.fullmatch(k) and int(k) <= MAX_INT):
            raise BadState(f"{where} has key {k[:40]!r}, not an integer in [0, 2**62]")
        check_value(v, f"{where}[{k!r}]")
    return value


def _fragment(value: object, where: str) -> None:
    fs = _obj(value, where)
    if "index" in fs:  # optional: restore takes the fragment's position in the list without it
        _int(fs["index"], f"{where}.index")
    for key in FRAGMENT_INTS:
        _int(_field(fs, key, where), f"{where}.{key}")
    for key in FRAGMENT_MAPS:
        _int_map(_field(fs, key, where), f"{where}.{key}")
    _int_map(_field(fs, "own_at_version", where), f"{where}.own_at_version", _int_map)
    if "tensors" in fs:  # names, read by inspect
        for i, name in enumerate(_list(fs["tensors"], f"{where}.tensors")):
            _str(name, f"{where}.tensors[{i}]")


def _learner(value: object, where: str) -> None:
    rec = _obj(value, where)
    unknown = sorted(set(rec) - set(LEARNER_INTS) - set(LEARNER_MAPS))
    if unknown:  # LearnerRecord(**record) would raise TypeError on them
        raise BadState(f"{where} has unknown fields {[k[:40] for k in unknown[:3]]}")
    for key in LEARNER_REQUIRED:
        _field(rec, key, where)
    for key in LEARNER_INTS:
        if key in rec:
            _int(rec[key], f"{where}.{key}")
    for key in LEARNER_MAPS:
        if key in rec:
            _int_map(rec[key], f"{where}.{key}")


def check_state(state: object) -> dict:
    """``state`` (a parsed ``state.json``) if it has every field restore (recovery.py,
    ``prune_covered``) and inspect read, of the type and range they need; else ``BadState``
    naming the field and what is wrong with it. The one place these rules live: a field
    that restore reads is checked here, so a bad one makes the folder ``Incomplete`` (and
    restore falls back to the previous complete checkpoint) rather than a traceback."""
    st = _obj(state, "it")
    _int(_field(st, "version", ""), "version")
    _str(_field(st, "run_id", ""), "run_id")
    _int(_field(st, "outer_steps", ""), "outer_steps")
    for i, fs in enumerate(_list(_field(st, "fragments", ""), "fragments")):
        _fragment(fs, f"fragments[{i}]")
    _int_map(_field(st, "learners", ""), "learners", _learner)
    if "pending" in st:  # absent in checkpoints from before pending deltas were recorded
        for i, pair in enumerate(_list(st["pending"], "pending")):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise BadState(f"pending[{i}] is {_show(pair)}, not a [learner, sequence] pair")
            _int(pair[0], f"pending[{i}][0]")
            _int(pair[1], f"pending[{i}][1]")
    if "tensors_sha256" in st:  # optional: read_folder compares it only where present
        _str(st["tensors_sha256"], "tensors_sha256")
    if "tensors_bytes" in st:  # optional too: read_folder reads no more than it says
        _int(st["tensors_bytes"], "tensors_bytes")
    return st


def read_folder(path: pathlib.Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and state of one checkpoint folder, verified (``Incomplete`` if not).
    Reads only: also for tools that inspect or export a run while it runs."""
    if not path.is_dir():
        raise Incomplete(f"{path.name}: folder missing")
    try:
        state = json.loads(read_file(path / STATE, MAX_RECORD_BYTES))
        # the tensors file's size is in the sealed state (checkpoints from before it: any
        # size, but a regular file): a sparse or damaged file is refused, not read whole
        size = state.get("tensors_bytes") if isinstance(state, dict) else None
        blob = read_file(path / TENSORS, size if type(size) is int and size >= 0 else 1 << 62)
    except FileNotFoundError as exc:
        raise Incomplete(f"{path.name}: {pathlib.Path(exc.filename).name} missing") from exc
    except (OSError, ValueError) as exc:
        raise Incomplete(f"{path.name}: {exc}") from exc
    if not isinstance(state, dict):
        raise Incomplete(f"{path.name}: {STATE} is {_show(state)}, not an object")
    if seal_holds(state) is False:  # None: a checkpoint from before states were sealed
        raise Incomplete(f"{path.name}: {STATE} does not match its own SHA-256")
    try:  # after the seal: damage is reported as damage; before the version is compared
        check_state(state)
    except BadState as exc:
        raise Incomplete(f"{path.name}: {STATE}: {exc}") from None
    key = folder_key(path)
    if key is not None and key[0] != state["version"]:
        raise Incomplete(f"{path.name}: {STATE} says version {state['version']}")
    want = state.get("tensors_sha256")
    if want is not None and hashlib.sha256(blob).hexdigest() != want:
        raise Incomplete(f"{path.name}: {TENSORS} does not match the SHA-256 in {STATE}")
    try:
        tensors = load_tensors(blob)
    except Exception as exc:  # safetensors raises its own error type for a bad file
        raise Incomplete(f"{path.name}: {TENSORS} does not parse: {exc}") from exc
    return tensors, state


class CheckpointStore:
    def __init__(self, state_dir: pathlib.Path, hook: Callable[[str], None] | None = None) -> None:
        self.state_dir = pathlib.Path(state_dir)
        self.root = self.state_dir / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        # called after each step of a write with the step's name; tests raise from it to
        # leave the folder exactly as a crash at that point would
        self.hook = hook or (lambda step: None)
        self.latest: pathlib.Path | None = None
        self._latest_key: str | None = None
        self._verified: dict[pathlib.Path, dict] = {}  # complete folders seen by this process -> state
        self.last_error: str | None = None  # the last failed write, until one succeeds
        self.failures = 0

    # ------------------------------------------------------------------ start
    def clean_temporaries(self) -> list[pathlib.Path]:
        """Torn `.tmp` folders and files a crash left (checkpoints, journal, merge and refusal records)."""
        removed = []
        for folder in (self.root, self.state_dir / "journal", self.state_dir / "merges", self.state_dir / "refusals", self.state_dir):
            removed += remove_temporaries(folder)
        return removed

    def _folders(self) -> list[pathlib.Path]:
        """Checkpoint folders, oldest first."""
        found = [p for p in self.root.iterdir() if p.is_dir() and folder_key(p) is not None]
        return sorted(found, key=folder_key)

    def _read(self, path: pathlib.Path) -> tuple[dict[str, torch.Tensor], dict]:
        return read_folder(path)

    def folders(self) -> list[pathlib.Path]:
        """Checkpoint folders, oldest first (complete or not)."""
        return self._folders()

    def _complete_state(self, path: pathlib.Path) -> dict | None:
        if path not in self._verified:
            try:
                self._verified[path] = self._read(path)[1]
            except Incomplete:
                return None
        return self._verified[path]

    def load(self) -> Loaded | None:
        """The checkpoint LATEST names if it is complete, else the newest complete one; None
        when there is none at all (a fresh run). Raises ``CheckpointError`` when folders exist
        but none is complete."""
        latest = latest_name(self.root)
        folders = self._folders()
        candidates = ([self.root / latest] if latest else []) + [p for p in reversed(folders) if p.name != latest]
        skipped = []
        for path in candidates:
            try:
                tensors, state = self._read(path)
            except Incomplete as exc:
                skipped.append(str(exc))
                continue
            self._verified[path] = state
            self.latest, self._latest_key = path, state_key(state)
            key = folder_key(self.root / latest) if latest else None
            return Loaded(path, tensors, state, skipped, key[0] if key else None)
        if candidates:
            raise CheckpointError(f"no complete checkpoint in {self.root}: " + "; ".join(skipped))
        return None

    # ------------------------------------------------------------------ writing
    def is_current(self, state: dict) -> bool:
        """Whether the newest checkpoint already holds exactly this state."""
        return self._latest_key is not None and self._latest_key == state_key(state) and self.latest is not None

    def write(self, tensors: dict[str, torch.Tensor], state: dict) -> tuple[pathlib.Path, bool]:
        """Write a checkpoint of ``state`` (with its ``version``); returns (folder, written).
        ``written`` is False when the newest checkpoint already holds this state."""
        if self.is_current(state):
            return self.latest, False
        version = state["version"]
        folders = self._folders()
        generation = max((folder_key(p)[1] for p in folders), default=0) + 1
        name = f"v{version:08d}-g{generation:06d}"
        tmp = self.root / f".{name}{TMP_MARK}"
        final = self.root / name
        blob = save_tensors(tensors, metadata={"version": str(version)})
        state = seal(dict(state, tensors_sha256=hashlib.sha256(blob).hexdigest(), tensors_bytes=len(blob),
                          written_at=time.time()))
        try:
            with _storage(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                self.hook("folder")
                _write_file(tmp / TENSORS, blob)
                self.hook("tensors")
                write_json(tmp / STATE, state)
                fsync_dir(tmp)
                self.hook("state")
            with _storage(final):
                tmp.rename(final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves nothing behind
            raise
        with _storage(self.root):
            fsync_dir(self.root)
        self.hook("renamed")
        write_bytes(self.root / LATEST, name.encode())
        self._verified[final] = state
        self.latest, self._latest_key = final, state_key(state)
        self.hook("latest")
        self._prune(final)
        return final, True

    def record_failure(self, exc: Exception) -> None:
        self.failures += 1
        self.last_error = str(exc)

    def recovered(self) -> bool:
        """Clears the failure after a successful write; True if there was one."""
        had, self.last_error = self.last_error is not None, None
        return had

    # ------------------------------------------------------------------ pruning
    def _prune(self, newest: pathlib.Path) -> None:
        """Delete checkpoints older than the previous complete one, and the merge records and
        journal entries that previous one covers. Deletion only: a crash in the middle
        leaves extra files, never missing ones."""
        older = [p for p in self._folders() if p != newest and folder_key(p) < folder_key(newest)]
        fallback, fallback_state = None, None
        for path in reversed(older):
            fallback_state = self._complete_state(path)
            if fallback_state is not None:
                fallback = path
                break
        for path in older:
            if path != fallback:
                shutil.rmtree(path, ignore_errors=True)
                self._verified.pop(path, None)
                self.hook("removed")
        if fallback_state is not None:
            prune_covered(self.state_dir, fallback_state)
            self.hook("pruned")


def prune_covered(state_dir: pathlib.Path, state: dict) -> None:
    """Delete the merge records, journal entries and stale-refusal records checkpoint
    ``state`` already holds."""
    for path in (state_dir / "merges").glob("*.json"):
        if path.stem.isdigit() and int(path.stem) <= state["version"]:
            path.unlink(missing_ok=True)
    refused = {int(k): r.get("last_seq_refused_stale", 0) for k, r in state["learners"].items()}
    for path in (state_dir / "refusals").glob("*.json"):
        key = parse_refusal_name(path)
        if key is not None and key[1] <= refused.get(key[0], 0):
            path.unlink(missing_ok=True)  # counted in that checkpoint's record of the learner
    if "pending" not in state:  # a checkpoint from before pending deltas were recorded
        return
    accepted = {int(k): r["last_seq_accepted"] for k, r in state["learners"].items()}
    pending = {tuple(x) for x in state["pending"]}
    for path in (state_dir / "journal").glob("*.delta"):
        key = parse_name(path)
        # covered once accepted and no longer pending (merged): by sequence alone is not
        # enough when fragments merge out of order
        if key is not None and key[1] <= accepted.get(key[0], 0) and key not in pending:
            path.unlink(missing_ok=True)
