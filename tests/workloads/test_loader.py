"""Naming a workload: every way the name or the function can be wrong is refused with a
message naming the workload and what is wrong, before anything trains."""

from __future__ import annotations

import pytest

from ddiloco.workloads import WorkloadError, load
from ddiloco.workloads.loader import absolute
from wl_helpers import config, write


def refused(cfg, *fragments: str) -> str:
    with pytest.raises(WorkloadError) as info:
        load(cfg)
    message = str(info.value)
    for f in fragments:
        assert f in message, message
    return message


def test_a_module_function_and_a_file_function_both_load(tmp_path):
    assert load(config("ddiloco.workloads.bytegpt:workload")).name == "ddiloco.workloads.bytegpt:workload"
    name = write(tmp_path)
    wl = load(config(name))
    assert wl.build_model().weight.shape == (1, 4)


def test_the_function_receives_the_options_and_the_run(tmp_path):
    name = write(tmp_path, source=(
        "import ddiloco.workloads.bytegpt as b\n"
        "def workload(args):\n"
        "    w = b.ByteGPT(args.run)\n"
        "    w.seen = (dict(args), args.run.seed)\n"
        "    return w\n"))
    wl = load(config(name, {"depth": "3"}, seed=9))
    assert wl.impl.seen == ({"depth": "3"}, 9)


def test_a_name_without_a_function_is_refused():
    refused(config("ddiloco.workloads.bytegpt"), "expected MODULE:FUNCTION")
    refused(config("ddiloco.workloads.bytegpt:not a name"), "not a Python function name")


def test_a_module_that_does_not_import_is_refused_with_its_error(tmp_path):
    refused(config("no_such_module_here:workload"), "no_such_module_here:workload", "cannot import")
    broken = write(tmp_path, source="raise RuntimeError('config file missing')\n")
    refused(config(broken), "importing", "RuntimeError: config file missing")
    refused(config(str(tmp_path / "absent.py") + ":workload"), "no such file")


def test_a_missing_or_uncallable_function_is_refused(tmp_path):
    refused(config("ddiloco.workloads.bytegpt:nothing"), "has no attribute 'nothing'")
    refused(config("ddiloco.workloads.bytegpt:EVAL_BATCH"), "is a int, not a function")


def test_a_function_that_raises_is_refused_with_its_error(tmp_path):
    refused(config("ddiloco.workloads.bytegpt:workload", {"size": "9"}), "'ddiloco.workloads.bytegpt:workload'",
            "calling it failed", "takes no --workload-arg (got ['size'])")
    name = write(tmp_path, source="def workload(args):\n    raise KeyError('width')\n")
    refused(config(name), "calling it failed: KeyError: 'width'")


def test_an_edited_file_is_read_again(tmp_path):
    name = write(tmp_path)
    assert load(config(name)).build_model().weight.shape == (1, 4)
    write(tmp_path, "def model(self):\n    return nn.Linear(4, 2)\n")
    assert load(config(name)).build_model().weight.shape == (2, 4)


def test_an_object_without_the_methods_is_refused_naming_each_missing_one(tmp_path):
    name = write(tmp_path, source="class Half:\n    def model(self): pass\n    loss = 3\ndef workload(args):\n    return Half()\n")
    refused(config(name), "returned a Half without", "train_batches()", "loss()", "batch_weight()", "eval_batches()")


def test_a_relative_file_is_made_absolute_and_a_module_left_alone(tmp_path):
    assert absolute("examples/x.py:workload", tmp_path) == f"{tmp_path / 'examples' / 'x.py'}:workload"
    assert absolute("pkg.mod:fn", tmp_path) == "pkg.mod:fn"


def test_check_refuses_what_load_refuses_with_the_same_message(tmp_path):
    from ddiloco.workloads import check

    bad_builtin = config("ddiloco.workloads.bytegpt:workload", {"size": "9"})
    with pytest.raises(WorkloadError) as info:
        check(bad_builtin)
    assert str(info.value) == refused(bad_builtin)
    for cfg in (config(write(tmp_path, source="def workload(args):\n    raise KeyError('width')\n")),
                config("ddiloco.workloads.bytegpt:nothing")):
        with pytest.raises(WorkloadError) as info:
            check(cfg)
        assert str(info.value) == refused(cfg)
    check(config("ddiloco.workloads.bytegpt:workload"))  # accepted, as load accepts it
    check(config(write(tmp_path, name="good.py")))


def test_checking_the_built_in_workload_imports_no_torch():
    """The coordinator checks the run's configuration before it serves; for the built-in
    workload that check must not cost a torch import (seconds of CPU)."""
    import subprocess
    import sys

    code = (
        "import argparse, sys\n"
        "from ddiloco.common.config import RunConfig\n"
        "from ddiloco.workloads import check\n"
        "check(RunConfig())\n"
        "from ddiloco.coordinator import cli\n"
        "from ddiloco.common.runflags import run_config_from_args\n"
        "parser = argparse.ArgumentParser()\n"
        "cli.add_arguments(parser)\n"
        "run_config_from_args(parser.parse_args(['--learners', '3']))\n"  # the coordinator's own path
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
