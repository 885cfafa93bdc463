"""A learner that built the run's initial model itself never downloads it
(``PullGlobalRequest.have_digest``, ddiloco.outer.downloads), against a real outer
optimizer over gRPC.

* Claiming version 0 with the digest of the seeded model, while the fragment is at version
  0, gets the change since that copy: zeros, in a payload of a few hundred bytes instead of
  the full fragment, and the claimed copy becomes the learner's view, from which later
  downloads are changes.
* Once the fragment has moved past version 0, the same claim gets every merge so far as one
  quantized change from version 0 (the outer optimizer keeps each fragment's version 0),
  no bigger than a change of one merge, a fraction of the full fragment; the learner's
  start-up pull then asks once more, and that second change leaves its copy within the
  quantizer's step of the first one's error.
* A digest of another copy gets the full fragment, as a pull without a claim does; a digest
  that is not 32 bytes is INVALID_ARGUMENT.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ddiloco.common import codec
from ddiloco.common.config import RunConfig
from ddiloco.common.fragments import partition
from ddiloco.common.model import build_model
from ddiloco.common.transport import OuterClient
from ddiloco.v1 import outer_pb2

RUN = "held-run"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from outer_helpers import serving_run_with_config

    yield from serving_run_with_config(tmp_path_factory.mktemp("held"), RUN)


def seeded_fragment(cfg: RunConfig, fragment: int = 0) -> list[tuple[str, np.ndarray]]:
    """What a learner builds from the run's configuration, as its fragment's arrays."""
    named = [(n, p.detach().numpy().copy()) for n, p in build_model(cfg.model, cfg.seed).named_parameters()]
    ids = partition([a.size for _, a in named], cfg.fragments)[fragment]
    return [named[i] for i in ids]


def test_a_learner_holding_the_current_version_downloads_next_to_nothing(system):
    cluster, (a, b), cfg = system
    mine = seeded_fragment(cfg)
    full = OuterClient(cluster.outer_address, RUN, b).pull(0, -1, timeout=30)
    assert full.base_version == -1 and full.version == 0
    for (_, x), (_, y) in zip(full.arrays, mine):
        np.testing.assert_array_equal(x, y)  # the outer's version 0 is the seeded model

    got = OuterClient(cluster.outer_address, RUN, a).pull(0, 0, timeout=30, have_digest=codec.held_digest([x for _, x in mine]))
    assert got.base_version == 0 and got.version == 0
    assert all(not d.any() for _, d in got.arrays)  # nothing changed since the learner's copy
    assert got.nbytes < full.nbytes / 100, (got.nbytes, full.nbytes)


def test_another_copy_or_a_malformed_digest_gets_the_full_fragment_or_a_refusal(system):
    cluster, (a, _), cfg = system
    client = OuterClient(cluster.outer_address, RUN, a)
    other = [x + 1e-3 for _, x in seeded_fragment(cfg)]
    got = client.pull(0, 0, timeout=30, have_digest=codec.held_digest(other))
    assert got.base_version == -1
    with pytest.raises(grpc.RpcError) as info:
        client.pull_payload(0, 0, timeout=30, have_digest=b"\x00" * 31)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "32-byte" in info.value.details()


def test_once_the_fragment_moved_on_a_newcomer_gets_the_change_since_the_seeded_copy_and_a_held_view_serves_changes(system):
    from support import wait_until

    cluster, (a, b), cfg = system
    mine = seeded_fragment(cfg)
    digest = codec.held_digest([x for _, x in mine])
    # learner a's view is the seeded copy it claimed; learner b merges a delta (quorum 1 of 2)
    assert OuterClient(cluster.outer_address, RUN, a).pull(0, 0, timeout=30, have_digest=digest).base_version == 0
    client_b = OuterClient(cluster.outer_address, RUN, b)
    g = client_b.pull(0, -1, timeout=30)
    rng = np.random.default_rng(0)
    delta = [(n, rng.uniform(-1e-3, 1e-3, size=x.shape).astype(np.float32)) for n, x in g.arrays]
    window_tokens = cfg.learner.inner_steps * cfg.learner.batch_size * cfg.model.context
    resp = client_b.push(codec.encode(delta, "fp32"), seq=1, base_version=g.version, tokens=window_tokens,
                         inner_steps=cfg.learner.inner_steps, loss=3.0, timeout=60)
    assert resp.outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED
    wait_until(lambda: client_b.status().version > 0, 60, "the merge")

    now = client_b.pull(0, -1, timeout=30)
    assert now.version > 0
    late = OuterClient(cluster.outer_address, RUN, b).pull(0, 0, timeout=30, have_digest=digest)
    assert late.base_version == 0  # a newcomer holding the seeded model: the change since it
    assert late.nbytes < now.nbytes / 2.5, (late.nbytes, now.nbytes)  # int8: about a third
    step = max(float(np.abs(y - x).max()) for (_, x), (_, y) in zip(mine, now.arrays)) / 127
    for (_, d), (_, x), (_, y) in zip(late.arrays, mine, now.arrays):
        np.testing.assert_allclose(x + d, y, rtol=0, atol=step)  # within int8's step of the change
    change = OuterClient(cluster.outer_address, RUN, a).pull(0, 0, timeout=30)
    assert change.base_version == 0  # learner a's view is the copy it claimed: a change, quantized
    for (_, d), (_, x), (_, y) in zip(change.arrays, mine, now.arrays):
        np.testing.assert_allclose(x + d, y, atol=2e-3 / 127 * 2)  # within int8's step of the change


def test_a_learner_starting_after_merges_downloads_changes_not_the_model_and_refines_its_copy(system, tmp_path):
    """The learner's start-up pull (``Puller.pull_all``) against the real outer optimizer,
    after the merges of the test above: one change from the seeded copy, then one more from
    the copy that left; neither is the full fragment, both are smaller than it, and the copy
    ends far closer to the global parameters than the first change alone put it."""
    import json

    from ddiloco.common.metrics import MetricsLog
    from ddiloco.learner.puller import Puller
    from ddiloco.learner.stats import Stats

    cluster, (a, b), cfg = system
    client = OuterClient(cluster.outer_address, RUN, b)
    now = client.pull(0, -1, timeout=30)
    assert now.version > 0, "runs after the test above, which merged"
    log = tmp_path / "puller.jsonl"
    puller = Puller(lambda: client, b, cfg.fragments, 1000, 0.02, Stats(), MetricsLog(log, "learner"))
    mine = seeded_fragment(cfg)
    copy = puller.pull_all(timeout=30, held=[mine])[0]
    pulls = [json.loads(line) for line in log.read_text().splitlines()]
    pulls = [e for e in pulls if e["event"] == "pull"]
    assert [(e["start"], e["full"], e["refine"]) for e in pulls] == [(True, False, False), (True, False, True)]
    assert all(e["bytes"] < now.nbytes / 2.5 for e in pulls), (pulls, now.nbytes)
    assert copy.version == now.version
    step = max(float(np.abs(y - x).max()) for (_, x), (_, y) in zip(mine, now.arrays)) / 127
    for (_, x), (_, y) in zip(copy.arrays, now.arrays):
        # the first change's error (half a step) quantized once more, plus float32 rounding of the sums
        bound = step / 2 / 127 + 2 * np.spacing(np.abs(y))
        assert (np.abs(x - y) <= bound).all(), float((np.abs(x - y) - bound).max())



class _LosesTheRefine:
    """The real client, except that the answer to the second start-up download (asked from
    the version the copy already is) is damaged in transit once, after the outer optimizer
    made it: a fault injected between two real processes, as a flipped bit would be."""

    def __init__(self, client: OuterClient) -> None:
        self.client, self.lost = client, 0

    def __getattr__(self, name):
        return getattr(self.client, name)

    def pull(self, fragment, have_version, **kw):
        got = self.client.pull(fragment, have_version, **kw)
        if have_version >= 0 and got.version == have_version and not self.lost:
            from ddiloco.common.transport import CorruptDownload

            self.lost += 1
            raise CorruptDownload(f"fragment {fragment}: digest mismatch (injected)")
        return got


def test_a_refined_copy_whose_answer_was_lost_is_asked_again_in_full(system, tmp_path):
    """The outer optimizer remembers the copy a refine leaves under the version it was asked
    from, in place of the copy before it. When that answer is lost, the learner still holds
    the copy before it, which the server no longer knows: another change from that version
    would land on the wrong copy, off by the whole refine, and no later download would
    correct it. The learner asks for the fragment in full instead: its copy is the global
    parameters, and the server's record of it agrees (a change asked from it is all zeros)."""
    import json

    from ddiloco.common.metrics import MetricsLog
    from ddiloco.learner.puller import Puller
    from ddiloco.learner.stats import Stats

    cluster, (a, b), cfg = system
    client = _LosesTheRefine(OuterClient(cluster.outer_address, RUN, b))
    now = client.client.pull(0, -1, timeout=30)
    assert now.version > 0, "runs after the tests above, which merged"
    log = tmp_path / "puller.jsonl"
    puller = Puller(lambda: client, b, cfg.fragments, 1000, 0.02, Stats(), MetricsLog(log, "learner"))
    puller.backoff_initial_s = 0.01
    copy = puller.pull_all(timeout=30, held=[seeded_fragment(cfg)])[0]
    assert client.lost == 1
    events = [json.loads(line) for line in log.read_text().splitlines()]
    pulls = [(e["start"], e["full"], e["refine"]) for e in events if e["event"] == "pull"]
    assert pulls == [(True, False, False), (True, True, True)], pulls
    assert copy.version == now.version
    for (_, x), (_, y) in zip(copy.arrays, now.arrays):
        np.testing.assert_array_equal(x, y)
    again = client.client.pull(0, copy.version, timeout=30)
    assert again.base_version == copy.version
    assert all(not d.any() for _, d in again.arrays), "the server's record of the copy is not the copy"

def test_a_restarted_outer_optimizer_still_holds_version_0(tmp_path):
    """Version 0 is rebuilt from the run's seed at every start, before the checkpoint is
    restored over the global parameters: after merges and a restart it is still the seeded
    model, bit for bit, while the global parameters are the restored ones."""
    from outer_helpers import push, tiny_config

    from ddiloco.outer.state import OuterState

    cfg = tiny_config("held-restart")
    state = OuterState(cfg, tmp_path)
    push(state, 0, 1, seed=1)
    assert state.merge(0, force=True)
    assert state.checkpoint() is not None
    restored = OuterState(cfg, tmp_path)
    assert restored.version == state.version > 0
    seeded = seeded_fragment(cfg)
    _, _, now = restored.snapshot(0)
    for kept, (_, x), (_, y) in zip(restored.initial_fragment(0), seeded, now):
        np.testing.assert_array_equal(kept, x)
        assert not kept.flags.writeable  # a learner's download view may share it
        assert not np.array_equal(kept, y)  # the global parameters moved on
