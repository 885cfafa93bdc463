"""The whole system: coordinator, outer optimizer and 3 learner processes train a real
model on real text over gRPC, and the run leaves a complete report."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

REPORT_KEYS = {
    "initial_eval_loss", "final_eval_loss", "final_eval_accuracy", "tokens_trained", "outer_steps",
    "bytes_uploaded", "bytes_downloaded", "wall_seconds", "model_parameters", "learners",
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from support import TINY_RUN

    out = tmp_path_factory.mktemp("e2e")
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "run", "--learners", "3", "--max-seconds", "25", "--out", str(out), "--quiet",
         "--device", "cpu", *TINY_RUN],
        capture_output=True, text=True, timeout=400,
    )
    return proc, out


def test_run_exits_zero_and_prints_a_summary(finished_run):
    proc, _ = finished_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| eval loss |" in proc.stdout
    # and the run's overlap, from its own event log (ddiloco.report.overlap)
    assert re.search(r"\| overlap \| \d+\.\d\d of \d+\.\d steps per window trained on the old base", proc.stdout), proc.stdout


def test_report_has_every_key_and_loss_went_down(finished_run):
    _, out = finished_run
    report = json.loads((out / "report.json").read_text())
    assert REPORT_KEYS <= set(report)
    assert report["final_eval_loss"] < report["initial_eval_loss"] - 0.5
    assert 0 < report["final_eval_accuracy"] <= 1
    assert report["outer_steps"] > 0 and report["tokens_trained"] > 0
    assert report["bytes_uploaded"] > 0 and report["bytes_downloaded"] > 0


def test_every_learner_trained_and_had_deltas_merged(finished_run):
    _, out = finished_run
    report = json.loads((out / "report.json").read_text())
    learners = report["learners"]
    assert len(learners) == 3
    for lr in learners:
        assert lr["tokens"] > 0 and lr["inner_steps"] > 0
        assert lr["deltas_merged"] > 0, f"learner {lr['learner_id']} had nothing merged"
        assert lr["deltas_sent"] >= lr["deltas_merged"]
        assert lr["deltas_accepted"] >= lr["deltas_merged"]  # the outer optimizer's own counts


def test_run_folder_holds_config_and_an_event_log(finished_run):
    _, out = finished_run
    config = json.loads((out / "config.json").read_text())
    assert config["learners"] == 3
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert {"merge", "eval", "window", "upload_acked", "pull", "finished"} <= kinds
    versions = [e["version"] for e in events if e["event"] == "merge"]
    assert versions == sorted(versions), "the global version only ever increases"


def test_checkpoint_on_disk_is_loadable(finished_run):
    from safetensors.torch import load_file

    _, out = finished_run
    ckpt_root = out / "outer" / "checkpoints"
    latest = ckpt_root / (ckpt_root / "LATEST").read_text().strip()
    tensors = load_file(str(latest / "global.safetensors"))
    state = json.loads((latest / "state.json").read_text())
    assert any(k.startswith("param/") for k in tensors) and any(k.startswith("momentum/") for k in tensors)
    assert state["version"] == json.loads((out / "report.json").read_text())["global_version"]


def test_the_exported_model_evaluates_to_the_reported_final_loss(finished_run, tmp_path):
    """`ddiloco export` of the finished run, loaded into a fresh model, gives the eval loss
    report.json states (the same held-out windows the outer optimizer evaluates)."""
    from safetensors.torch import load_file

    from ddiloco.common.config import RunConfig
    from ddiloco.common.data import eval_windows, load_corpus
    from ddiloco.common.model import build_model, evaluate

    _, out = finished_run
    model_file = tmp_path / "model.safetensors"
    proc = subprocess.run([sys.executable, "-m", "ddiloco", "export", str(out), "--out", str(model_file)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cfg = RunConfig.from_json((out / "config.json").read_text())
    model = build_model(cfg.model, seed=cfg.seed + 1)
    model.load_state_dict(load_file(str(model_file)), strict=True)
    corpus = load_corpus(cfg.data, cfg.learners)
    loss, _ = evaluate(model, eval_windows(corpus.eval_bytes, cfg.model.context, cfg.data.eval_windows))
    assert loss == pytest.approx(json.loads((out / "report.json").read_text())["final_eval_loss"], rel=1e-6)


def test_ddiloco_report_plots_the_run_from_a_copy_of_its_folder(finished_run, tmp_path):
    import shutil

    _, out = finished_run
    copy = tmp_path / "copied-run"  # as if brought over from another machine
    shutil.copytree(out, copy)
    proc = subprocess.run([sys.executable, "-m", "ddiloco", "report", str(copy)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plots = copy / "plots"
    for name in ("eval_loss.png", "bytes.png", "merges.png", "goodput.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    summary = (plots / "summary.md").read_text()
    report = json.loads((out / "report.json").read_text())
    assert f"| final eval loss, accuracy | {report['final_eval_loss']:.4f}" in summary
    assert f"| outer steps | {report['outer_steps']} |" in summary
    assert "![eval_loss](eval_loss.png)" in summary


def test_the_run_made_its_own_ca_and_logged_no_key(finished_run):
    """`ddiloco run` is mutual TLS by default: a fresh CA and a certificate per service in
    RUN/tls, keys readable by their owner only and in no log."""
    import stat

    _, out = finished_run
    keys = sorted((out / "tls").rglob("*.key"))
    names = {k.parent.name for k in keys}
    assert {"tls", "coordinator", "outer", "operator", "learner-0", "learner-1", "learner-2"} <= names
    assert all(stat.S_IMODE(k.stat().st_mode) == 0o600 for k in keys)
    logs = "".join(p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))
    assert "PRIVATE KEY" not in logs
    for key in keys:
        assert "".join(key.read_text().splitlines()[1:-1])[:40] not in logs


def test_a_learner_downloads_at_most_once_per_delta_sent_each_no_bigger_than_an_upload(finished_run):
    """Downloads are the change since the learner's copy, quantized like its uploads (int8
    here) and pulled once its own delta of that fragment was merged: after the one start-up
    copy a learner starts from, it receives no more changes of a fragment than it sent deltas
    of it, each no bigger than one of its uploads (report.json counts both; the events say
    which pull was which), so the download direction is never bigger than the upload one.
    Before that bound, a loaded CI run had 210 downloads against about 206 uploads: windows
    queued together travel as one upload, and a catch-up came on top.

    The start-up copy is never the full fragment: every learner built the run's seeded model
    itself, so it gets the change since it, nothing while the fragment is still at version 0
    and otherwise one quantized change (no bigger than an upload) and, at once, a second from
    the copy that left, for what the quantizer lost. The first start-up copy of the run comes
    before any merge (a merge needs a learner that has all its fragments), so it is always a
    change of nothing."""
    _, out = finished_run
    report = json.loads((out / "report.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["learner"]["codec"] == "int8"
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for lr in report["learners"]:
        me = lr["learner_id"]
        pulls = [e for e in events if e["event"] == "pull" and e["learner"] == me]
        start = [e for e in pulls if e["start"]]
        changes = [e for e in pulls if not e["start"]]
        first = [e for e in start if not e["refine"]]
        assert sorted(e["fragment"] for e in first) == list(range(config["fragments"])), "one start-up copy per fragment"
        assert not any(e["full"] for e in pulls), "the seeded model is every learner's start: never the fragment in full"
        assert sum(e["bytes"] for e in pulls) == lr["bytes_downloaded"]
        for f in range(config["fragments"]):
            sent = sum(1 for e in events if e["event"] in ("upload_acked", "upload_refused")
                       and e["learner"] == me and e["fragment"] == f)
            mine = sum(1 for e in changes if e["fragment"] == f)
            assert 0 < mine <= sent, f"learner {me}, fragment {f}: {mine} downloads for {sent} deltas sent"
        per_upload = lr["bytes_uploaded"] / lr["deltas_acked"]
        assert max(e["bytes"] for e in changes) <= per_upload, (
            f"learner {me}: a download of {max(e['bytes'] for e in changes)} bytes, uploads of {per_upload:.0f}")
        refused = sum(1 for e in events if e["event"] == "upload_refused" and e["learner"] == me)
        for e in first:
            refined = [r for r in start if r["refine"] and r["fragment"] == e["fragment"]]
            if e["version"] == 0:
                assert e["bytes"] < 10_000 and not refined, e  # the seeded model: nothing to send
            else:  # merges since: one change, then its residual
                assert e["bytes"] <= per_upload and len(refined) == 1 and refined[0]["bytes"] <= per_upload, (e, refined)
        if not refused:  # report.json counts the bytes of acknowledged uploads
            assert sum(e["bytes"] for e in changes) <= lr["bytes_uploaded"]
    first = min((e for e in events if e["event"] == "pull" and e["start"]), key=lambda e: e["t"])
    assert not first["full"], first  # before any merge: the learner's own model, not downloaded
