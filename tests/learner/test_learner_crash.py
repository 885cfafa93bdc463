"""A one-process learner whose training raises (a device error, out of memory, a bug in a
workload's data) fails as what it is: the failure is recorded (``learner_failed``, the
coordinator's Leave reason) and the process exits non-zero after flushing the windows it
had trained, so that its orchestrator restarts it and the restart resumes from the
acknowledged work. Before, the error left as a clean drain ("drained", failed false) and the
process died by traceback at interpreter exit.

Real processes: coordinator, outer optimizer and learner; the error is raised by the
workload's own data stream (a workload file written here), at its 26th batch."""

from __future__ import annotations

import json
import pathlib

from support import wait_until

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "mlp_regression.py"

FAILING = f'''
import importlib.util

spec = importlib.util.spec_from_file_location("mlp_regression_base", {str(EXAMPLE)!r})
base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(base)


class Failing(base.MLPRegression):
    def train_batches(self, shard, num_shards, seed, start):
        for i, batch in enumerate(super().train_batches(shard, num_shards, seed, start)):
            if i == 25:
                raise RuntimeError("simulated device error")
            yield batch


def workload(args):
    return Failing(32, 32)
'''


def _events(out: pathlib.Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


def test_a_learner_whose_training_raises_fails_loudly_after_flushing_its_windows(cluster_factory, tmp_path):
    workload = tmp_path / "failing_workload.py"
    workload.write_text(FAILING)
    cluster = cluster_factory(["--workload", f"{workload}:workload", "--inner-steps", "10", "--max-tokens", "10000000"],
                              max_seconds=300)
    learner = cluster.start_learner(0, ["--device", "cpu"])
    assert learner.popen.wait(timeout=240) == 1, learner.log_path.read_text()[-3000:]

    failed = _events(cluster.out, "learner_failed")
    assert len(failed) == 1 and failed[0]["cause"].startswith("train: RuntimeError: simulated device error"), failed
    stop = _events(cluster.out, "learner_stop")[-1]
    assert stop["failed"] and stop["flushed"], stop
    # the two whole windows trained before the error (H = 10) were sent and acknowledged; the
    # five steps of the window it broke are not sent (a restart trains them again)
    acked = [e for e in _events(cluster.out, "upload_acked") if e["learner"] == 0]
    assert sum(e["tokens"] for e in acked) == 2 * 10 * 32, acked
    wait_until(lambda: _events(cluster.out, "learner_left"), 30, "the coordinator to record the leave")
    assert _events(cluster.out, "learner_left")[-1]["reason"].startswith("failed: train: RuntimeError"), _events(
        cluster.out, "learner_left")
    assert "training failed (train)" in learner.log_path.read_text()
