"""From a workload's name to a checked workload object.

A name is ``module.path:function`` (imported like any module, so it must be importable in
every process of the run) or ``path/to/file.py:function`` (loaded from that file; the CLI
makes a relative path absolute before the configuration is handed to the services, whose
working folders differ). Every way this can go wrong ends in a ``WorkloadError`` that
names the workload and says what is wrong, before any training starts.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import pathlib
import sys
from typing import TYPE_CHECKING, Any, Callable

from ddiloco.common.config import DEFAULT_WORKLOAD, RunConfig
from ddiloco.workloads.errors import REQUIRED, WorkloadError

if TYPE_CHECKING:
    from ddiloco.workloads.checked import Workload

__all__ = ["DEFAULT_WORKLOAD", "WorkloadArgs", "absolute", "check", "load", "resolve", "split_name"]


class WorkloadArgs(dict):
    """The options a workload function receives: ``--workload-arg KEY=VALUE`` as a dict of
    strings, and the run configuration at ``.run`` (its seed, learner count, batch size,
    for workloads that want them; the built-in one reads its model and data sections)."""

    def __init__(self, values: dict[str, str], run: RunConfig) -> None:
        super().__init__(values)
        self.run = run


def split_name(name: str) -> tuple[str, str]:
    """``(module or file, function)`` of a workload name; WorkloadError if malformed."""
    module, sep, function = name.rpartition(":")
    if not sep or not module or not function:
        raise WorkloadError(f"workload {name!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    if not function.isidentifier():
        raise WorkloadError(f"workload {name!r}: {function!r} is not a Python function name")
    return module, function


def absolute(name: str, cwd: pathlib.Path | None = None) -> str:
    """``name`` with a relative ``FILE.py`` made absolute against ``cwd`` (default: the
    current folder); a module name is returned unchanged."""
    module, function = split_name(name)
    if not module.endswith(".py"):
        return name
    path = pathlib.Path(module)
    if not path.is_absolute():
        path = (cwd or pathlib.Path.cwd()) / path
    return f"{path.resolve()}:{function}"


def _import(name: str, module: str):
    if module.endswith(".py"):
        path = pathlib.Path(module)
        if not path.is_file():
            raise WorkloadError(f"workload {name!r}: no such file {module}")
        # one module per file and content, named after both: loading it again (the check,
        # then the run) reuses it, two files of the same name do not collide, and a file
        # that changed is read again
        ident = str(path.resolve()).encode() + b"\0" + path.read_bytes()
        key = "ddiloco_workload_" + hashlib.sha256(ident).hexdigest()[:16]
        if key in sys.modules:
            return sys.modules[key]
        spec = importlib.util.spec_from_file_location(key, path)
        if spec is None or spec.loader is None:
            raise WorkloadError(f"workload {name!r}: {module} cannot be loaded as a Python module")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[key]
            raise
        return mod
    return importlib.import_module(module)


def resolve(name: str) -> Callable[[WorkloadArgs], Any]:
    """The workload function ``name`` designates."""
    module, function = split_name(name)
    try:
        mod = _import(name, module)
    except WorkloadError:
        raise
    except ModuleNotFoundError as exc:
        raise WorkloadError(f"workload {name!r}: cannot import {module!r}: {exc}") from exc
    except Exception as exc:  # the user's module failed while importing: say so, with its error
        raise WorkloadError(f"workload {name!r}: importing {module!r} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(mod, function, None)
    if fn is None:
        raise WorkloadError(f"workload {name!r}: {module!r} has no attribute {function!r}")
    if not callable(fn):
        raise WorkloadError(f"workload {name!r}: {module}.{function} is a {type(fn).__name__}, not a function")
    return fn


def check(run: RunConfig) -> None:
    """Raise ``WorkloadError`` unless ``load(run)`` would succeed: the name resolves, the
    function accepts the options and returns an object with the methods. The built-in
    workload is checked by its options rule alone, without importing it: its object always
    has the methods, and importing it imports torch, about two seconds of CPU before a
    service that only checks the configuration (the coordinator) could serve."""
    if run.workload.name == DEFAULT_WORKLOAD:
        from ddiloco.workloads.bytegpt_options import check_options

        try:
            check_options(run.workload.args)
        except WorkloadError as exc:  # worded as load's, which calls the function
            raise _call_failed(run.workload.name, str(exc)) from None
        return
    load(run)


def _call_failed(name: str, detail: str) -> WorkloadError:
    return WorkloadError(f"workload {name!r}: calling it failed: {detail}")


def load(run: RunConfig) -> "Workload":
    """Call the run's workload function with its options and check what it returns."""
    from ddiloco.workloads.checked import Workload

    name = run.workload.name
    fn = resolve(name)
    try:
        impl = fn(WorkloadArgs(dict(run.workload.args), run))
    except Exception as exc:  # e.g. options it refuses: its message, with the workload named
        detail = str(exc) if isinstance(exc, WorkloadError) else f"{type(exc).__name__}: {exc}"
        raise _call_failed(name, detail) from exc
    missing = [m for m in REQUIRED if not callable(getattr(impl, m, None))]
    if missing:
        raise WorkloadError(
            f"workload {name!r} returned a {type(impl).__name__} without {', '.join(m + '()' for m in missing)} "
            f"(a workload has {', '.join(m + '()' for m in REQUIRED)})"
        )
    metric = getattr(impl, "metric", None)
    if metric is not None and not callable(metric):
        raise WorkloadError(f"workload {name!r}: metric is a {type(metric).__name__}, not a method")
    return Workload(name, impl, run)
