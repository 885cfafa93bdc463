"""The built-in workload's options rule, without the workload (which imports torch).

``bytegpt.workload`` applies it when a process builds the workload; ``loader.check`` applies
it alone when a process only checks a run's configuration (the coordinator, before it
serves), so that the rule is one and the check costs no torch import.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddiloco.workloads.errors import WorkloadError


def check_options(options: Mapping[str, str]) -> None:
    """The built-in workload is set by the run's own flags; it takes no ``--workload-arg``."""
    if len(options):
        raise WorkloadError(
            f"the built-in workload takes no --workload-arg (got {sorted(options)}); "
            "its settings are --model, --data, --data-bytes and --batch-size"
        )
