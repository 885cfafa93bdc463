"""Where a global model comes from: a run folder, one checkpoint folder, or an export.

Everything here only reads. A run folder's checkpoints are found under
``RUN/outer/checkpoints`` (the newest complete one, or the one of ``--version``), its model
configuration in ``RUN/config.json``. Deltas merged after the newest checkpoint live in the
outer optimizer's journal and are not part of what is read (a finished run's last
checkpoint holds its final version).

The model a source holds is the run's workload's (``ddiloco.workloads``): its parameters
are whatever that workload's ``model()`` lists, under the same names.

A workload is code (``MODULE:FUNCTION`` or ``FILE.py:FUNCTION``), and a source names its
own (an export's metadata, a run folder's ``config.json``). Reading a source never runs the
code it names: a warm start takes the parameter names from the run's own model (the
workload the user gave the run), and building the model a source names (``to_model``) is
done for the built-in workload, or for another only when the caller trusts it
(``ddiloco export --trust-workload``). A file that names ``helper.py:workload`` would
otherwise have every reader import the ``helper.py`` beside it: code from received bytes.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ddiloco.common import durable
from ddiloco.common.config import DEFAULT_WORKLOAD, ModelConfig, RunConfig
from ddiloco.outer.checkpoint import CheckpointError, Incomplete, folder_key, latest_name, read_folder

PARAM, MOMENTUM = "param/", "momentum/"
META_MODEL = "ddiloco.model_config"  # export metadata: the built-in model's ModelConfig as JSON
META_CONFIG = "ddiloco.run_config"  # export metadata: the whole RunConfig (its workload) as JSON
META_VERSION = "ddiloco.version"
META_RUN = "ddiloco.run_id"


class SourceError(Exception):
    """The path holds no global model that can be read (the message says why)."""


@dataclass
class GlobalModel:
    run_config: RunConfig  # the run's configuration: its workload builds the model
    params: dict[str, torch.Tensor]  # parameter name (as named_parameters) -> tensor
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict = field(default_factory=dict)  # the checkpoint's state.json ({} for an export)
    version: int = -1
    run_id: str = ""
    origin: str = ""  # what was read, for messages
    # newer checkpoints passed over as not usable (why): what was read is an older version
    skipped: list[str] = field(default_factory=list)

    @property
    def model_config(self) -> ModelConfig:
        return self.run_config.model

    @property
    def workload(self) -> str:
        return self.run_config.workload.name

    def to_model(self, trust_workload: bool = False) -> torch.nn.Module:
        """A fresh model of the run's workload holding these parameters. A workload other than
        the built-in one is code the source names: built only if ``trust_workload``
        (``SourceError`` otherwise, nothing imported)."""
        model = _build(self.run_config, self.origin, trust_workload)
        named = dict(model.named_parameters())
        # an export of a workload whose code was not run at reading holds the whole state
        # dict: a tied tensor under each of its names
        params = {k: v for k, v in self.params.items() if k in named or k not in model.state_dict()}
        if set(named) != set(params):
            raise SourceError(
                f"{self.origin}: parameters do not match the model configuration: "
                f"missing {sorted(set(named) - set(params))}, unexpected {sorted(set(params) - set(named))}"
            )
        with torch.no_grad():
            for name, p in named.items():
                t = params[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise SourceError(f"{self.origin}: {name} has shape {tuple(t.shape)}, the model {tuple(p.shape)}")
                p.copy_(t)
        return model


def _build(cfg: RunConfig, origin: str, trusted: bool) -> torch.nn.Module:
    """The model of ``cfg``'s workload. ``trusted``: the workload is the caller's (the run's
    own configuration), or the caller accepts running the one a source names."""
    from ddiloco.workloads import WorkloadError, load

    if not trusted and cfg.workload.name != DEFAULT_WORKLOAD:
        raise SourceError(
            f"{origin}: its model is built by the workload {cfg.workload.name!r}, code that building it would "
            "import and run; ddiloco runs the workload a model names only when told to trust it (--trust-workload)"
        )
    try:
        return load(cfg).build_model()
    except WorkloadError as exc:
        raise SourceError(f"{origin}: {exc}") from exc


def check_matches(g: GlobalModel, cfg: RunConfig, built: torch.nn.Module | None = None) -> None:
    """Raise ``SourceError`` unless ``g`` holds exactly the parameters, with the same
    shapes, that the run's workload builds (a warm start must fit the run's model).
    ``built``: that model, if the caller has built it already (it is not built again)."""
    model = built if built is not None else _build(cfg, "the run's workload", trusted=True)
    want = {n: tuple(p.shape) for n, p in model.named_parameters()}
    have = {n: tuple(t.shape) for n, t in g.params.items()}
    if want != have:
        diff = sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))
        shown = ", ".join(f"{n}: {have.get(n, 'absent')} here, {want.get(n, 'absent')} in the run's model" for n in diff[:3])
        raise SourceError(f"{g.origin} does not fit the run's model ({len(diff)} tensors differ; {shown})")
    for name in sorted(want):
        t = g.params[name]
        # a run started from NaN trains NaN (its learners fail late, naming the workload's
        # loss, not the file); an integer or boolean tensor is no trained parameter
        if not t.is_floating_point():
            raise SourceError(f"{g.origin}: {name} is {t.dtype}, not a floating-point parameter")
        if not bool(torch.isfinite(t).all()):
            raise SourceError(f"{g.origin}: {name} holds NaN or Inf")


def load_for_run(path: pathlib.Path, cfg: RunConfig, built: torch.nn.Module | None = None) -> GlobalModel:
    """The model at ``path`` as a warm start of the run ``cfg`` (``--init-from``): read with
    the parameter names of the run's own model (``built``, or built here from the run's
    workload), never with the code the source names; ``SourceError`` unless it fits."""
    model = built if built is not None else _build(cfg, "the run's workload", trusted=True)
    source = load(path, names={n for n, _ in model.named_parameters()})
    check_matches(source, cfg, model)
    return source


def load_into(model: torch.nn.Module, path: pathlib.Path, cfg: RunConfig) -> GlobalModel:
    """``model``, the run's model as built, set to the parameters at ``path`` (a warm start:
    ``--init-from``); returns what was read. ``SourceError`` where they do not fit it."""
    source = load_for_run(path, cfg, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(source.params[name].float())
    return source


def load(path: pathlib.Path, version: int | None = None, names: set[str] | None = None) -> GlobalModel:
    """The global model at ``path``: a run folder, a checkpoint folder or an exported
    ``.safetensors`` file. ``version`` picks one of a run's kept checkpoints. ``names``: the
    parameter names of the model it is for (an export holds a state dict, where a tied
    tensor appears under each of its names); None: the built-in model's, or every tensor of
    an export whose workload is another (its code is not run to find out)."""
    path = pathlib.Path(path)
    if path.is_file():
        if version is not None:
            raise SourceError(f"{path}: --version applies to a run folder, not to an exported file")
        return _load_export(path, names)
    if (path / "global.safetensors").exists() or (path / "state.json").exists():
        return _load_checkpoint(path, _run_config(path.parent.parent.parent, path))
    if (path / "outer-0" / "checkpoints").is_dir():
        if version is not None:
            raise SourceError(f"{path}: a run of several outer shards has a version per shard; --version does not apply")
        return _load_sharded(path)
    checkpoints = path / "outer" / "checkpoints"
    if not checkpoints.is_dir():
        raise SourceError(f"{path}: not a run folder (no outer/checkpoints), checkpoint folder or exported file")
    return _from_folder(checkpoints, _run_config(path, path), path, version)


def _from_folder(
    checkpoints: pathlib.Path, cfg: RunConfig, origin: pathlib.Path, version: int | None = None
) -> GlobalModel:
    """The checkpoint of ``version`` kept in ``checkpoints``, or (None) the one LATEST names,
    falling back to the newest complete one; ``origin`` names the run (or shard) in messages."""
    folders = sorted((p for p in checkpoints.iterdir() if p.is_dir() and folder_key(p) is not None), key=folder_key)
    if not folders:
        raise SourceError(f"{origin}: the run has no checkpoint yet")
    if version is not None:
        chosen = [p for p in folders if folder_key(p)[0] == version]
        if not chosen:
            kept = sorted({folder_key(p)[0] for p in folders})
            raise SourceError(f"{origin}: no checkpoint of version {version}; the run keeps versions {kept}")
        return _load_checkpoint(chosen[-1], cfg)
    try:
        latest = latest_name(checkpoints)
    except CheckpointError as exc:
        raise SourceError(str(exc)) from None
    order = ([checkpoints / latest] if latest else []) + [p for p in reversed(folders) if p.name != latest]
    problems = []
    for folder in order:
        try:
            found = _load_checkpoint(folder, cfg)
        except SourceError as exc:
            problems.append(str(exc))
            continue
        found.skipped = problems
        return found
    raise SourceError(f"{origin}: no complete checkpoint: " + "; ".join(problems))


def _load_sharded(path: pathlib.Path) -> GlobalModel:
    """A run of several outer shards: each shard's newest checkpoint holds its fragments'
    tensors; together they are the global model, at the sum of the shards' versions."""
    cfg = _run_config(path, path)
    if cfg.outer_shards < 2:
        raise SourceError(f"{path}: has outer-0/ but its configuration has {cfg.outer_shards} outer shard")
    parts = [_from_folder(path / f"outer-{i}" / "checkpoints", cfg, path / f"outer-{i}") for i in range(cfg.outer_shards)]
    params: dict[str, torch.Tensor] = {}
    momentum: dict[str, torch.Tensor] = {}
    for part in parts:
        overlap = set(params) & set(part.params)
        if overlap:
            raise SourceError(f"{part.origin}: holds {sorted(overlap)[:3]}, which another shard's checkpoint holds too")
        params.update(part.params)
        momentum.update(part.momentum)
    version = sum(p.version for p in parts)
    state = {"version": version, "run_id": parts[0].run_id, "shards": [p.state for p in parts]}
    return GlobalModel(cfg, params, momentum, state, version, parts[0].run_id, ", ".join(p.origin for p in parts),
                       skipped=[s for p in parts for s in p.skipped])


def _run_config(run: pathlib.Path, origin: pathlib.Path) -> RunConfig:
    cfg_path = run / "config.json"
    if not cfg_path.exists():
        raise SourceError(f"{origin}: no config.json in the run folder {run} (the model configuration comes from it)")
    try:
        cfg = RunConfig.from_json(durable.read_file(cfg_path, durable.MAX_RECORD_BYTES).decode())
    except OSError as exc:
        raise SourceError(f"{cfg_path}: cannot be read: {exc}") from exc
    except (ValueError, TypeError) as exc:
        raise SourceError(f"{cfg_path}: not a run configuration: {exc}") from exc
    _check_config(cfg, str(cfg_path))
    return cfg


def _check_config(cfg: RunConfig, where: str) -> None:
    """A configuration read from a source is held to the rules the CLI holds one to (a model
    of n_head 0 was a ZeroDivisionError traceback in the reader)."""
    from ddiloco.common.config_rules import problems

    found = problems(cfg)
    if found:
        raise SourceError(f"{where} is not a run configuration ddiloco can build: {found[0]}")


def _load_checkpoint(folder: pathlib.Path, cfg: RunConfig) -> GlobalModel:
    try:
        tensors, state = read_folder(folder)
    except Incomplete as exc:
        raise SourceError(f"checkpoint {folder}: {exc}") from exc
    params = {k[len(PARAM):]: v for k, v in tensors.items() if k.startswith(PARAM)}
    momentum = {k[len(MOMENTUM):]: v for k, v in tensors.items() if k.startswith(MOMENTUM)}
    return GlobalModel(cfg, params, momentum, state, int(state["version"]), str(state.get("run_id", "")), str(folder))


def _load_export(path: pathlib.Path, names: set[str] | None) -> GlobalModel:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a bad file
        raise SourceError(f"{path}: not a safetensors file: {exc}") from exc
    if META_CONFIG in meta:
        try:
            cfg = RunConfig.from_json(meta[META_CONFIG])
        except (ValueError, TypeError) as exc:
            raise SourceError(f"{path}: bad {META_CONFIG} metadata: {exc}") from exc
    elif META_MODEL in meta:  # written before workloads: the built-in model of this configuration
        try:
            cfg = RunConfig(model=ModelConfig(**json.loads(meta[META_MODEL])))
        except (ValueError, TypeError) as exc:
            raise SourceError(f"{path}: bad {META_MODEL} metadata: {exc}") from exc
    else:
        raise SourceError(f"{path}: no {META_CONFIG} metadata (not written by `ddiloco export`)")
    _check_config(cfg, f"{path}: its metadata")
    # an export holds the state dict: tied tensors appear under every name; keep the
    # parameter names (as named_parameters lists them)
    if names is None and cfg.workload.name == DEFAULT_WORKLOAD:
        from ddiloco.common.model import gpt_parameter_count

        # the model is built from the file's declared configuration: not one larger than the
        # values the file holds (a 550 kB file declaring 1,024 layers of width 8,192 had a
        # model of 825 billion parameters built before anything was compared)
        declared, held = gpt_parameter_count(cfg.model), sum(t.numel() for t in tensors.values())
        if declared > held:
            raise SourceError(
                f"{path}: its metadata declares a model of {declared:,} parameters, but it holds {held:,} values"
            )
        names = {n for n, _ in _build(cfg, str(path), trusted=True).named_parameters()}
    params = {k: v for k, v in tensors.items() if names is None or k in names}
    return GlobalModel(cfg, params, {}, {}, int(meta.get(META_VERSION, -1)), meta.get(META_RUN, ""), str(path))
