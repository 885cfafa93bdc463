"""``ddiloco run --pace-transfers`` with fragments of unequal size (learner/pace.py): a real
run whose learners pace their uploads and downloads, each by its own fragment's share of the
parameters. The spans' arithmetic is tested in tests/learner/test_pace.py; this holds the
wiring: the learners pace, nothing fails, and every window trained is acknowledged."""

from __future__ import annotations

import json
import subprocess
import sys

from support import TINY_RUN


def test_a_paced_run_with_unequal_fragments_paces_its_transfers_and_loses_nothing(tmp_path):
    out = tmp_path / "run"
    # 2 learners x 40 steps of 4 x 64 tokens, H = 8 over 4 fragments: a window ends every 2
    # steps of 0.25 s, so a transfer is spread over about 0.4 s, in chunks of a few kB (the
    # tiny model's int4 fragments are 16 to 19 kB: whole tensors, not alike)
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "run", "--learners", "2", "--max-tokens", str(2 * 40 * 4 * 64),
         "--max-seconds", "120", "--out", str(out), "--quiet", "--insecure", "--no-monitoring", *TINY_RUN,
         "--inner-steps", "8", "--step-seconds", "0.25", "--fragments", "4", "--codec", "int4", "--pace-transfers"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acked = [e for e in events if e["event"] == "upload_acked"]
    sizes = {e["fragment"]: e["raw_bytes"] for e in acked}
    assert len(set(sizes.values())) > 1, sizes  # the fragments differ in size
    assert sum(1 for e in acked if e["paced_s"] > 0) >= len(acked) // 2, [e["paced_s"] for e in acked]
    windows = [e for e in events if e["event"] == "window"]
    assert {(e["learner"], e["fragment"]) for e in acked} == {(e["learner"], e["fragment"]) for e in windows}
    assert not [e for e in events if e["event"] == "learner_failed"]
    report = json.loads((out / "report.json").read_text())
    for learner in report["learners"]:
        mine = [e for e in acked if e["learner"] == learner["learner_id"]]
        assert learner["deltas_sent"] == len(mine) > 0 and learner["deltas_merged"] > 0, learner
