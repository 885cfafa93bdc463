"""``ddiloco export``: the global model of a run as a plain state dict.

The file holds ``model.state_dict()`` under its own names (the tied output head appears
as ``head.weight`` beside ``wte.weight``, as torch lists it), so
``model.load_state_dict(safetensors.torch.load_file(path))`` loads it into a fresh
``ddiloco.common.model.GPT``; the metadata carries the model configuration, the version
and the run id, which ``ddiloco generate`` and ``ddiloco inspect`` read back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from safetensors.torch import save

from ddiloco.common.durable import StorageError, write_bytes
from ddiloco.modelio.source import META_CONFIG, META_MODEL, META_RUN, META_VERSION, SourceError, load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=pathlib.Path, help="a run folder or one checkpoint folder")
    parser.add_argument("--version", type=int, default=None, help="one of the run's kept checkpoint versions (default: the newest)")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the .safetensors file to write")
    parser.add_argument(
        "--trust-workload", action="store_true",
        help="build the model with the workload the source names when it is not the built-in one "
        "(that imports and runs its code; without this flag such a source is refused)",
    )


def export(source: pathlib.Path, out: pathlib.Path, version: int | None = None, trust_workload: bool = False) -> dict:
    """Write the state dict; returns what was written (version, run id, tensors, bytes).
    ``trust_workload``: build the model with a workload other than the built-in one that the
    source names (its code runs)."""
    g = load(source, version)
    model = g.to_model(trust_workload)
    # clone: the tied head shares its storage with the embedding, which safetensors refuses
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    meta = {
        META_MODEL: json.dumps(dataclasses.asdict(g.model_config)),
        META_CONFIG: g.run_config.to_json(),  # the workload (and its options) that builds the model
        META_VERSION: str(g.version),
        META_RUN: g.run_id,
    }
    blob = save(tensors, metadata=meta)
    write_bytes(out, blob)  # atomic: a crash leaves the old file or the new one, never half
    return {"version": g.version, "run_id": g.run_id, "tensors": len(tensors), "bytes": len(blob), "from": g.origin,
            "skipped": g.skipped}


def main(args: argparse.Namespace) -> int:
    if args.out.suffix != ".safetensors":
        print(f"ddiloco export: error: --out must end in .safetensors, got {args.out}", file=sys.stderr)
        return 2
    if not args.out.parent.is_dir():
        print(f"ddiloco export: error: the folder of --out does not exist: {args.out.parent}", file=sys.stderr)
        return 2
    try:
        info = export(args.source, args.out, args.version, args.trust_workload)
    except SourceError as exc:
        print(f"ddiloco export: error: {exc}", file=sys.stderr)
        return 2
    except StorageError as exc:
        print(f"ddiloco export: error: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    for reason in info["skipped"]:  # an older version than the run's newest: say so, and why
        print(f"ddiloco export: warning: passed over a newer checkpoint that is not usable: {reason}", file=sys.stderr)
    print(f"wrote {args.out} ({info['bytes']:,} bytes, {info['tensors']} tensors): version {info['version']} "
          f"of run {info['run_id'] or '?'} from {info['from']}")
    return 0
