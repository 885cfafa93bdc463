"""Flags and their environment variables: every bad value is one error line and exit code
2, before anything is created; --help names each variable and each run flag's default;
durations take one form everywhere."""

from __future__ import annotations

import pytest

from ddiloco.cli import main
from ddiloco.common.cliargs import duration


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, f"more than one line: {err!r}"
    return err


@pytest.mark.parametrize("name,value,message", [
    ("DDILOCO_SYNC", "ture", "DDILOCO_SYNC='ture': expected one of 1/true/yes/on or 0/false/no/off"),
    ("DDILOCO_LEARNERS", "four", "DDILOCO_LEARNERS='four': not a valid int for --learners"),
    ("DDILOCO_MODEL", "huge", "DDILOCO_MODEL='huge': --model must be one of"),
    ("DDILOCO_MAX_SECONDS", "soon", "DDILOCO_MAX_SECONDS='soon': not a valid duration for --max-seconds"),
])
def test_a_bad_environment_value_is_one_error_line_and_exit_2(monkeypatch, capsys, tmp_path, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        main(["coordinator", "--run-dir", str(tmp_path / "never")])
    assert exc.value.code == 2
    assert _error_line(capsys).startswith(f"ddiloco coordinator: error: {message}")
    assert not (tmp_path / "never").exists()


def test_an_empty_environment_value_counts_as_unset(monkeypatch, capsys):
    monkeypatch.setenv("DDILOCO_LEARNERS", "")
    with pytest.raises(SystemExit) as exc:
        main(["coordinator", "--help"])
    assert exc.value.code == 0


def test_help_names_each_variable_and_each_run_flags_default(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "[env DDILOCO_MAX_SECONDS]" in text and "[env DDILOCO_OUT]" in text
    assert "(default: 150.0)" in text  # --max-seconds: the same default for run and coordinator
    assert "(default: 0.7)" in text  # --outer-lr


def test_durations_take_one_form_everywhere():
    assert duration("600") == duration("600s") == duration("10m") == 600.0
    assert duration("1.5h") == 5400.0 and duration("500ms") == 0.5
    with pytest.raises(ValueError, match="not a duration"):
        duration("10 minutes")


def test_ddiloco_run_refuses_a_bad_run_flag_before_creating_anything(tmp_path, capsys):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exc:
        main(["run", "--model", "tiny", "--codec", "int3", "--out", str(out)])
    assert exc.value.code == 2
    assert _error_line(capsys).startswith("ddiloco run: error: argument --codec: invalid choice: 'int3'")
    assert not out.exists()
    assert main(["run", "--model", "tiny", "--learners", "0", "--out", str(out)]) == 2
    assert _error_line(capsys) == "ddiloco run: error: --learners must be an integer from 1 to 1,000,000, got 0"
    assert not out.exists()
    assert main(["run", "--model", "tiny", "--max-seconds", "0", "--out", str(out)]) == 2
    assert "--max-seconds must be a positive, finite duration" in _error_line(capsys)
    assert not out.exists()


def test_choices_are_choices_and_a_bad_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["coordinator", "--merge-rule", "median"])
    assert exc.value.code == 2
    line = _error_line(capsys)
    assert line.startswith("ddiloco coordinator: error: argument --merge-rule: invalid choice: 'median'")
    assert "weighted" in line


def test_sync_without_a_quorum_waits_for_every_learner():
    import argparse

    from ddiloco.common.runflags import add_run_flags, run_config_from_args

    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    assert run_config_from_args(parser.parse_args(["--sync", "--learners", "6"])).outer.quorum == 6
    assert run_config_from_args(parser.parse_args(["--sync", "--learners", "6", "--quorum", "3"])).outer.quorum == 3
    assert run_config_from_args(parser.parse_args(["--learners", "6"])).merge_quorum() == 3


def test_the_default_quorum_is_half_the_learners_rounded_up_and_a_set_one_is_kept():
    import argparse

    from ddiloco.common.runflags import add_run_flags, run_config_from_args

    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    for m, k in ((1, 1), (2, 1), (3, 2), (4, 2), (8, 4), (16, 8), (17, 9)):
        cfg = run_config_from_args(parser.parse_args(["--learners", str(m)]))
        assert (cfg.outer.quorum, cfg.merge_quorum()) == (0, k), m
    assert run_config_from_args(parser.parse_args(["--learners", "16", "--quorum", "1"])).merge_quorum() == 1
    assert run_config_from_args(parser.parse_args(["--learners", "16", "--quorum", "16"])).merge_quorum() == 16


def test_config_print_writes_the_effective_configuration_a_config_file_takes(monkeypatch, capsys, tmp_path):
    import json

    from ddiloco.common.config import RunConfig

    monkeypatch.setenv("DDILOCO_INNER_STEPS", "30")
    assert main(["config", "--print", "--model", "tiny", "--learners", "8", "--sync", "--max-seconds", "10m"]) == 0
    text = capsys.readouterr().out
    cfg = RunConfig.from_json(text)
    assert (cfg.learners, cfg.learner.inner_steps, cfg.learner.sync, cfg.outer.quorum, cfg.max_seconds) == (8, 30, True, 8, 600.0)
    (tmp_path / "run.json").write_text(text)
    assert main(["config", "--config", str(tmp_path / "run.json")]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(text)


def test_dp_lists_only_the_run_flags_it_reads(capsys):
    with pytest.raises(SystemExit):
        main(["dp", "--help"])
    text = capsys.readouterr().out
    assert "--batch-size" in text and "--max-tokens" in text and "--learners" in text
    assert "--init-from" in text  # dp starts from a given model too (a comparison from one warm start)
    for diloco_only in ("--quorum", "--codec", "--outer-lr", "--sync", "--fragments", "--merge-rule"):
        assert diloco_only not in text, diloco_only
    with pytest.raises(SystemExit) as exc:
        main(["dp", "--quorum", "3"])
    assert exc.value.code == 2 and "unrecognized arguments: --quorum 3" in capsys.readouterr().err


def _bad_values():
    """For every rule with a flag, a value of the right type that the run cannot use."""
    from ddiloco.common.config_rules import RULES

    bad = {"--max-seconds": "0", "--block-size": "3", "--outer-momentum": "1.0", "--max-coalesce-windows": "2000",
           "--seed": "-1", "--learners": "0", "--fragments": "0", "--max-tokens": "-5", "--overlap-steps": "-1"}
    for path, flag, _, allowed in RULES:
        if flag is not None:
            yield flag, bad.get(flag, "-1"), allowed


@pytest.mark.parametrize("flag,value,allowed", list(_bad_values()))
def test_every_run_flag_with_a_value_the_run_cannot_use_is_one_error_and_creates_nothing(tmp_path, capsys, flag, value, allowed):
    out = tmp_path / "never"
    assert main(["run", "--model", "tiny", flag, value, "--out", str(out)]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"ddiloco run: error: {flag} must be {allowed}"), line
    assert not out.exists()


def test_a_model_whose_width_does_not_split_into_its_heads_is_refused(tmp_path):
    from ddiloco.common.config import RunConfig
    from ddiloco.common.config_rules import problems

    cfg = RunConfig()
    cfg.model.d_model, cfg.model.n_head = 100, 3
    assert problems(cfg) == ["model.d_model (100) must be a multiple of model.n_head (3)"]
    assert problems(RunConfig()) == []


def test_a_quorum_above_the_runs_learners_is_refused_saying_what_it_would_mean():
    from ddiloco.common.config import RunConfig
    from ddiloco.common.config_rules import problems

    cfg = RunConfig(learners=4)
    cfg.outer.quorum = 4
    assert problems(cfg) == []
    cfg.outer.quorum = 5
    assert problems(cfg) == ["--quorum (5) must be at most --learners (4): "
                             "a merge waits for at most every live learner, which is --quorum 4"]


def test_a_chunk_size_the_services_channels_cannot_carry_is_refused():
    from ddiloco.common.config import RunConfig
    from ddiloco.common.config_rules import MAX_CHUNK_BYTES, problems
    from ddiloco.common.rpc import MAX_MESSAGE_BYTES

    cfg = RunConfig()
    cfg.learner.chunk_bytes = MAX_CHUNK_BYTES
    assert problems(cfg) == [] and MAX_CHUNK_BYTES < MAX_MESSAGE_BYTES
    cfg.learner.chunk_bytes = MAX_CHUNK_BYTES + 1
    assert problems(cfg) == [f"learner.chunk_bytes must be from 1 KiB to 8 MiB, got {MAX_CHUNK_BYTES + 1}"]


def test_pace_transfers_reaches_the_run_config_and_the_coordinators_flags_and_is_refused_with_sync():
    import argparse

    from ddiloco.common.runflags import add_run_flags, forward_run_flags, run_config_from_args

    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    assert run_config_from_args(parser.parse_args([])).learner.pace_transfers is False
    args = parser.parse_args(["--pace-transfers", "--fragments", "4"])
    assert run_config_from_args(args).learner.pace_transfers is True
    assert "--pace-transfers" in forward_run_flags(args)
    with pytest.raises(SystemExit) as err:
        run_config_from_args(parser.parse_args(["--pace-transfers", "--sync"]))
    assert str(err.value).startswith("--pace-transfers cannot be used with --sync")
