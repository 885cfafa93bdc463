"""The `ddiloco` command line.

Each sub-command lives in its own module, which exposes ``add_arguments(parser)`` and
``main(args) -> int``. Modules are imported only when their command runs, so that light
commands such as ``ddiloco health`` (a container healthcheck, run every few seconds) never
pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("ddiloco.launcher.cli", "train: coordinator, outer optimizer and N learners as local processes"),
    "config": ("ddiloco.launcher.config_cmd", "print the effective run configuration of these flags (validated, as JSON)"),
    "coordinator": ("ddiloco.coordinator.cli", "serve the coordinator (membership, leases, run config)"),
    "outer": ("ddiloco.outer.cli", "serve the outer optimizer (global parameters, merges, checkpoints)"),
    "learner": ("ddiloco.learner.cli", "run one learner (inner AdamW loop, uploads pseudo-gradients)"),
    "health": ("ddiloco.common.health", "exit 0 only if HOST:PORT answers grpc.health.v1 SERVING"),
    "certs": ("ddiloco.common.certs_cli", "a run's CA and its services' certificates (mutual TLS), revocation"),
    "dp": ("ddiloco.baselines.cli", "baseline: synchronous data-parallel training (torch.distributed, gloo)"),
    "simulate": ("ddiloco.simulate.cli", "simulate training goodput under failures at datacenter scale"),
    "wan": ("ddiloco.wan.cli", "apply or show a WAN bandwidth profile with tc"),
    "netns": ("ddiloco.netns.cli", "manage network namespaces of the WAN topology"),
    "chaos": ("ddiloco.chaos.cli", "inject faults into a running system"),
    "export": ("ddiloco.modelio.export", "write a run's global model as a plain state dict (.safetensors)"),
    "inspect": ("ddiloco.modelio.inspect_cmd", "show what a checkpoint holds: versions, tokens, learners, norms"),
    "generate": ("ddiloco.modelio.generate", "sample text from a run's byte-level model"),
    "report": ("ddiloco.report.cli", "plots (PNG) and a markdown summary of a run folder"),
}


class OneLineErrors(argparse.ArgumentParser):
    """A bad flag is one line, ``ddiloco <cmd>: error: <what and what is allowed>``, and exit
    code 2 (``--help`` has the usage)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: ddiloco <command> [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "Run `ddiloco <command> --help` for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from ddiloco import __version__

        print(__version__)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"ddiloco: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, desc = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"ddiloco: command {name!r} is not available in this build", file=sys.stderr)
            return 2
        raise
    parser = OneLineErrors(prog=f"ddiloco {name}", description=desc)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    return int(module.main(args) or 0)
