"""The flags that build a ``RunConfig``, shared by ``ddiloco run`` and ``ddiloco coordinator``
(the coordinator owns the run config; ``run`` forwards these flags to it unchanged)."""

from __future__ import annotations

import argparse
import sys
import copy
import json
import pathlib

from ddiloco.common.cliargs import duration
from ddiloco.common.config import CODECS, MERGE_RULES, MODEL_PRESETS, RunConfig

# (flag, dest path in RunConfig, type, help)
_FLAGS: list[tuple[str, str, type, str]] = [
    ("--run-id", "run_id", str, "run identifier: 1 to 160 letters, digits or ._:- (default run)"),
    ("--learners", "learners", int, "M: number of learners (and data shards)"),
    ("--max-seconds", "max_seconds", duration, "training budget (600, 600s, 10m, 1.5h), from the first learner's arrival"),
    ("--max-tokens", "max_tokens", int, "token budget across learners (0: none)"),
    ("--seed", "seed", int, "seed of the initial model"),
    ("--workload", "workload.name", str, "what to train: MODULE:FUNCTION or FILE.py:FUNCTION (docs/workloads.md)"),
    ("--data", "data.path", str, "train on this text file or folder instead of the built-in corpus"),
    ("--data-bytes", "data.max_bytes", int, "read at most this many bytes of text"),
    ("--inner-steps", "learner.inner_steps", int, "H: inner steps between uploads"),
    ("--batch-size", "learner.batch_size", int, "sequences per inner step"),
    ("--lr", "learner.lr", float, "inner AdamW learning rate"),
    ("--codec", "learner.codec", str, f"pseudo-gradient codec: {', '.join(CODECS)}"),
    ("--block-size", "learner.block_size", int, "quantization block size"),
    ("--outer-lr", "outer.lr", float, "outer SGD learning rate"),
    ("--outer-momentum", "outer.momentum", float, "outer Nesterov momentum"),
    ("--staleness-gain", "outer.staleness_gain", float, "momentum memory shortens by this x staleness (default 0: off)"),
    ("--full-gain-rounds", "outer.full_gain_rounds", float, "rounds of a merge stepped at the full Nesterov gain; beyond, a backlog at unit gain (default 1)"),
    ("--quorum", "outer.quorum", int, "K: learners' deltas needed before a fragment merges (0, the default: half the learners)"),
    ("--fragments", "fragments", int, "P: parameter fragments, synced on staggered schedules"),
    ("--outer-shards", "outer_shards", int, "S: outer-optimizer shards, shard I owning the fragments f with f %% S == I (at most P)"),
    ("--merge-rule", "outer.merge_rule", str, "weighted | mean | rda"),
    ("--overlap-steps", "outer.overlap_steps", int, "tau: steps a learner computes while a fragment is in flight"),
    ("--max-staleness", "outer.max_staleness_rounds", float, "refuse deltas more than this many rounds stale"),
    ("--ranks-per-learner", "learner.ranks", int, "R: each learner a torch.distributed group of R processes on its host, "
     "data-parallel; one inner step weighs R batches"),
    ("--max-coalesce-windows", "learner.max_coalesce_windows", int, "windows summed into one delta at most before a learner waits for its uploads"),
    ("--checkpoint-every", "outer.checkpoint_every", int, "merges between checkpoints"),
    ("--eval-interval", "outer.eval_interval_s", float, "seconds between evaluations of the global model"),
    ("--lease-timeout", "lease_timeout_s", float, "seconds without heartbeat before a learner is dead"),
]


# the run flags the data-parallel baseline reads (``ddiloco dp`` lists only these; the
# others configure DiLoCo's learners and outer optimizer). --learners and --inner-steps are
# accepted so that one flag set serves both kinds of run: dp ignores the first (its shards
# are --world-size) and logs its training loss every --inner-steps steps.
DP_FLAGS = frozenset({
    "--config", "--model", "--workload", "--workload-arg", "--run-id", "--learners", "--max-seconds", "--max-tokens", "--seed", "--data",
    "--data-bytes", "--inner-steps", "--batch-size", "--lr", "--eval-interval", "--init-from",
})


def add_run_flags(parser: argparse.ArgumentParser, only: frozenset[str] | None = None) -> None:
    """The run configuration flags; ``only``: just these (e.g. ``DP_FLAGS``)."""
    group = parser.add_argument_group("run configuration")

    def add(flag: str, **kw) -> None:
        if only is None or flag in only:
            group.add_argument(flag, **kw)

    add("--config", type=pathlib.Path, default=None, help="start from this RunConfig JSON")
    add("--model", choices=sorted(MODEL_PRESETS), default=None, help="model size preset (default: small)")
    add("--workload-arg", dest="workload_args", action="append", type=workload_arg, default=None, metavar="KEY=VALUE",
        help="an option of the workload, repeatable (in the environment: several, separated by spaces, shell-quoted)")
    add("--sync", action="store_true", default=None, help="synchronous DiLoCo (barrier every H steps)")
    add("--naive-merge", action="store_true", default=None,
        help="apply a full synchronous outer step per arrival (diverges; for comparison only)")
    add("--dynamic-local-updates", action="store_true", default=None,
        help="slower learners sync after proportionally fewer inner steps")
    add("--init-from", type=pathlib.Path, default=None, metavar="PATH",
        help="warm start: the global model starts from this run folder, checkpoint folder or `ddiloco export` file")
    add("--no-align-windows", action="store_true", default=None,
        help="learners keep windows of exactly H steps (no phase alignment with their peers)")
    add("--pace-transfers", action="store_true", default=None,
        help="learners spread each upload and download over time, each direction at about 1.25 times its own "
             "average rate, instead of bursts at link speed (asynchronous mode; costs some quality: docs/wan.md)")
    defaults = RunConfig()
    for flag, dest, typ, help_ in _FLAGS:
        metavar = flag.lstrip("-").replace("-", "_").upper()
        # the default stays None (flag not given: the --config file or RunConfig decides);
        # the help shows what RunConfig gives when neither sets it
        shown = _lookup(defaults, dest)
        help_ = f"{help_} (default: {shown if shown != '' else 'none'})"
        choices = _CHOICES.get(flag)
        add(flag, dest="cfg_" + dest.replace(".", "__"), type=typ, default=None, help=help_,
            metavar=metavar if choices is None else None, choices=choices)


_CHOICES: dict[str, tuple[str, ...]] = {"--codec": CODECS, "--merge-rule": MERGE_RULES}


def _lookup(cfg: RunConfig, dest: str):
    target = cfg
    for part in dest.split("."):
        target = getattr(target, part)
    return target


def config_or_error(args: argparse.Namespace, command: str) -> RunConfig | None:
    """``run_config_from_args``, or None once its refusal is printed as ``ddiloco COMMAND:
    error: ...`` (every command that takes the run flags reads them this way, before a
    folder or a process exists)."""
    try:
        return run_config_from_args(args)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(f"ddiloco {command}: error: {exc.code}", file=sys.stderr)
            return None
        raise


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    args = _with_absent_flags(args)
    cfg = _config_file(args.config) if args.config else RunConfig()
    if args.model:
        cfg.model = copy.deepcopy(MODEL_PRESETS[args.model])
    if args.workload_args:
        cfg.workload.args.update(dict(args.workload_args))
    if args.sync:
        cfg.learner.sync = True
    if args.dynamic_local_updates:
        cfg.learner.dynamic_local_updates = True
    if getattr(args, "no_align_windows", None):
        cfg.learner.align_windows = False
    if getattr(args, "pace_transfers", None):
        cfg.learner.pace_transfers = True
    if args.naive_merge:
        cfg.outer.work_clock = False
    for _, dest, _, _ in _FLAGS:
        value = getattr(args, "cfg_" + dest.replace(".", "__"))
        if value is None:
            continue
        target = cfg
        *path, leaf = dest.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, leaf, value)
    if args.sync and args.cfg_outer__quorum is None and not (args.config and "quorum" in _json_section(args.config, "outer")):
        # synchronous DiLoCo merges every learner's window of a round together: quorum M
        # unless a quorum was set (quorum 1 would merge each window alone)
        cfg.outer.quorum = cfg.learners
    if cfg.learner.codec not in CODECS:
        raise SystemExit(f"--codec must be one of {CODECS}, got {cfg.learner.codec!r}")
    if cfg.outer.merge_rule not in MERGE_RULES:
        raise SystemExit(f"--merge-rule must be one of {MERGE_RULES}, got {cfg.outer.merge_rule!r}")
    from ddiloco.common.config_rules import problems

    found = problems(cfg)
    if found:
        raise SystemExit(found[0])
    _check_workload(cfg)
    if getattr(args, "init_from", None) is not None:
        cfg.init_from = str(args.init_from.resolve())
    if cfg.init_from:
        from ddiloco.modelio.source import SourceError, load_for_run

        try:
            load_for_run(pathlib.Path(cfg.init_from), cfg)
        except SourceError as exc:
            if getattr(args, "init_from", None) is None:  # from the run's saved configuration
                raise SystemExit(
                    f"the run's configuration starts it from --init-from {cfg.init_from}, which its services "
                    f"read again whenever they start, --resume included: {exc}; put it back at that path"
                ) from None
            raise SystemExit(f"--init-from: {exc}") from None
    return cfg


def workload_arg(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``--workload-arg`` as a pair."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _check_workload(cfg: RunConfig) -> None:
    """A FILE.py workload made absolute (the services run in other folders); the workload
    checked (``workloads.check``: a user's imported and called once, the built-in's options
    rule without importing torch), so that a name that does not resolve, options it refuses
    or an object without the methods end the command before anything starts."""
    from ddiloco.workloads import WorkloadError, check
    from ddiloco.workloads.loader import absolute

    try:
        cfg.workload.name = absolute(cfg.workload.name)
        check(cfg)
    except WorkloadError as exc:
        raise SystemExit(str(exc)) from None


def _with_absent_flags(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every run flag a parser did not define (``add_run_flags(only=...)``) as
    not given (None)."""
    names = ["config", "model", "workload_args", "sync", "naive_merge", "dynamic_local_updates", "init_from", "no_align_windows", "pace_transfers"]
    names += ["cfg_" + dest.replace(".", "__") for _, dest, _, _ in _FLAGS]
    return argparse.Namespace(**{**{n: None for n in names}, **vars(args)})


def _json_section(path: pathlib.Path, section: str) -> dict:
    value = json.loads(path.read_text()).get(section, {})  # the file parsed once already
    return value if isinstance(value, dict) else {}


def _config_file(path: pathlib.Path) -> RunConfig:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SystemExit(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        return RunConfig.from_json(text)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise SystemExit(f"--config {path}: {exc}") from None


def forward_run_flags(args: argparse.Namespace) -> list[str]:
    """Re-emit the run flags that were given, for a child coordinator process."""
    args = _with_absent_flags(args)
    out: list[str] = []
    if args.config:
        out += ["--config", str(args.config)]
    if args.model:
        out += ["--model", args.model]
    for key, value in args.workload_args or []:
        out += ["--workload-arg", f"{key}={value}"]
    if args.sync:
        out += ["--sync"]
    if args.dynamic_local_updates:
        out += ["--dynamic-local-updates"]
    if getattr(args, "no_align_windows", None):
        out += ["--no-align-windows"]
    if getattr(args, "pace_transfers", None):
        out += ["--pace-transfers"]
    if args.naive_merge:
        out += ["--naive-merge"]
    if getattr(args, "init_from", None) is not None:
        out += ["--init-from", str(args.init_from.resolve())]
    for flag, dest, _, _ in _FLAGS:
        value = getattr(args, "cfg_" + dest.replace(".", "__"))
        if value is not None:
            if flag == "--workload":  # the child may run in another folder than this command
                from ddiloco.workloads.loader import absolute

                value = absolute(value)
            out += [flag, str(value)]
    return out
