"""How a run names its workload: ``--workload``, ``--workload-arg KEY=VALUE`` (repeatable),
their environment variables and the run configuration; bad ones end the command with one
line before a run folder or a process exists."""

from __future__ import annotations

import argparse
import pathlib
import sys

import pytest

from ddiloco.cli import main
from ddiloco.common.cliargs import apply_env_defaults
from ddiloco.common.runflags import add_run_flags, forward_run_flags, run_config_from_args

WORKLOADS_TESTS = pathlib.Path(__file__).resolve().parents[1] / "workloads"
sys.path.insert(0, str(WORKLOADS_TESTS))
from wl_helpers import write  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    apply_env_defaults(parser)
    return parser.parse_args(argv)


def test_flags_name_the_workload_and_its_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path)
    args = parse(["--workload", "wl.py:workload", "--workload-arg", "width=8", "--workload-arg", "path=/a b=c"])
    cfg = run_config_from_args(args)
    assert cfg.workload.name == f"{tmp_path / 'wl.py'}:workload"  # made absolute: services run elsewhere
    assert cfg.workload.args == {"width": "8", "path": "/a b=c"}
    forwarded = forward_run_flags(args)
    assert forwarded[forwarded.index("--workload") + 1] == cfg.workload.name
    assert [forwarded[i + 1] for i, w in enumerate(forwarded) if w == "--workload-arg"] == ["width=8", "path=/a b=c"]


def test_the_environment_names_them_too(tmp_path, monkeypatch):
    name = write(tmp_path)
    monkeypatch.setenv("DDILOCO_WORKLOAD", name)
    monkeypatch.setenv("DDILOCO_WORKLOAD_ARG", "a=1 'b=two words'")
    cfg = run_config_from_args(parse([]))
    assert cfg.workload.name == name and cfg.workload.args == {"a": "1", "b": "two words"}


def test_the_default_is_the_built_in_model():
    assert run_config_from_args(parse([])).workload.name == "ddiloco.workloads.bytegpt:workload"


def test_an_option_without_a_value_is_a_flag_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["--workload-arg", "width"])
    assert exc.value.code == 2 and "expected KEY=VALUE, got 'width'" in capsys.readouterr().err


def test_ddiloco_run_refuses_a_workload_that_does_not_resolve_before_creating_anything(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["run", "--workload", "no_such_pkg.train:workload", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("ddiloco run: error: workload 'no_such_pkg.train:workload': cannot import 'no_such_pkg.train'")
    assert not out.exists()


def test_ddiloco_run_tries_the_workload_once_before_creating_anything(tmp_path, capsys):
    out = tmp_path / "never"
    name = write(tmp_path, "def loss(self, model, batch):\n    return model(batch)\n")
    assert main(["run", "--workload", name, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "wl.py:workload" in err and "loss() returned a tensor of shape (8, 1); it must be a scalar" in err
    assert not out.exists()
