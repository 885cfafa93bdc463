"""A learner's AdamW state, kept on its disk, brings a restarted learner back to where it
was, and is ignored (with the reason logged) whenever it is not this learner's state in
this run, or not a state AdamW can hold."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ddiloco.learner import inner_state

RUN = "run-a"


def _model(seed: int = 0) -> tuple[list[str], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(7, 5, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]
    return ["w", "b"], params


def _train(params, optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = sum((p * torch.randn(p.shape, generator=g)).sum() ** 2 for p in params)
        loss.backward()
        optimizer.step()


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


def test_a_restored_optimizer_takes_exactly_the_steps_the_uninterrupted_one_takes(tmp_path):
    names, params = _model()
    opt = _adamw(params)
    _train(params, opt, 6, seed=1)
    path = inner_state.path_for(tmp_path, 3)
    assert inner_state.save(path, RUN, 3, names, params, opt, schedule_step=6)

    # a restarted process: the same parameters (here: copies), a fresh optimizer
    _, again = _model()
    for a, p in zip(again, params):
        a.data.copy_(p.data)
    fresh = _adamw(again)
    restored = inner_state.restore(path, RUN, 3, names, again, fresh)
    assert restored == inner_state.Restored(adam_step=6, schedule_step=6)

    _train(params, opt, 4, seed=2)
    _train(again, fresh, 4, seed=2)
    for a, p in zip(again, params):
        assert torch.equal(a, p)  # bit for bit: the moments and the bias correction went on


def test_nothing_is_written_before_the_first_step(tmp_path):
    names, params = _model()
    path = inner_state.path_for(tmp_path, 0)
    assert not inner_state.save(path, RUN, 0, names, params, _adamw(params), schedule_step=0)
    assert not path.exists()
    assert inner_state.restore(path, RUN, 0, names, params, _adamw(params)) is None



def test_a_parameter_no_gradient_reached_is_kept_without_state_and_the_rest_is_restored_exactly(tmp_path):
    """A workload may have parameters AdamW never steps (frozen, or on a path no batch takes):
    they have no moments. The others' state is kept and restored all the same (before, one
    such parameter meant no state was ever written), and the restored optimizer still takes
    exactly the steps the uninterrupted one takes."""
    names, params = _model()
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    names, params = names + ["frozen"], params + [frozen]
    opt = _adamw(params)
    _train(params[:2], opt, 5, seed=1)
    path = inner_state.path_for(tmp_path, 2)
    assert inner_state.save(path, RUN, 2, names, params, opt, schedule_step=5)

    again = [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params]
    fresh = _adamw(again)
    restored = inner_state.restore(path, RUN, 2, names, again, fresh)
    assert restored == inner_state.Restored(adam_step=5, schedule_step=5, without_state=(2,))
    assert not fresh.state.get(again[2])
    _train(params[:2], opt, 3, seed=2)
    _train(again[:2], fresh, 3, seed=2)
    for a, p in zip(again, params):
        assert torch.equal(a, p)


@pytest.mark.parametrize("listed", ['[5]', '[0, 0]', '"2"', '[true]', 'not json', '[0, 1, 2]'])
def test_a_list_of_parameters_without_state_that_is_not_this_models_is_refused(tmp_path, listed, caplog):
    names, params = _model()
    names, params = names + ["frozen"], params + [torch.nn.Parameter(torch.ones(3), requires_grad=False)]
    opt = _adamw(params)
    _train(params[:2], opt, 2, seed=1)
    path = inner_state.path_for(tmp_path, 2)
    assert inner_state.save(path, RUN, 2, names, params, opt, schedule_step=2)
    _rewrite(path, meta_change=lambda meta: meta.update(without_state=listed))
    with caplog.at_level(logging.WARNING):
        assert inner_state.restore(path, RUN, 2, names, params, _adamw(params)) is None
    assert "without state is not one of this model's" in caplog.text


@pytest.fixture
def saved(tmp_path):
    names, params = _model()
    opt = _adamw(params)
    _train(params, opt, 3, seed=1)
    path = inner_state.path_for(tmp_path, 1)
    inner_state.save(path, RUN, 1, names, params, opt, schedule_step=3)
    return path, names, params


def _rewrite(path, meta_change=None, tensor_change=None):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    tensors = load_tensors(data)
    if meta_change:
        meta_change(meta)
    if tensor_change:
        tensor_change(tensors)
    path.write_bytes(save_tensors(tensors, metadata=meta))


def _refused(path, names, params, caplog, reason, run=RUN, learner=1):
    fresh = _adamw(params)
    with caplog.at_level(logging.WARNING, logger="ddiloco.learner.inner_state"):
        assert inner_state.restore(path, run, learner, names, params, fresh) is None
    assert not fresh.state  # a fresh optimizer, as before the file existed
    assert reason in caplog.text, caplog.text


def test_another_runs_state_is_ignored(saved, caplog):
    _refused(*saved, caplog, "it is run 'run-a''s, this run is 'run-b'", run="run-b")


def test_an_earlier_run_of_the_same_id_is_ignored(tmp_path, caplog):
    """Run ids are names users reuse ("run" by default): the coordinator's run instance tells
    runs apart. Restored, an earlier run's state started the new run past its warm-up."""
    names, params = _model()
    opt = _adamw(params)
    _train(params, opt, 3, seed=1)
    path = inner_state.path_for(tmp_path, 1)
    inner_state.save(path, RUN, 1, names, params, opt, schedule_step=3, run_instance="aaaa")
    fresh = _adamw(params)
    with caplog.at_level(logging.WARNING, logger="ddiloco.learner.inner_state"):
        assert inner_state.restore(path, RUN, 1, names, params, fresh, run_instance="bbbb") is None
    assert not fresh.state
    assert "it is an earlier run's of the same id 'run-a' (run instance 'aaaa', this run is 'bbbb')" in caplog.text
    # the same run (a restart, --resume) takes it back; so does a file written before run
    # instances, or a coordinator that does not send one
    assert inner_state.restore(path, RUN, 1, names, params, _adamw(params), run_instance="aaaa").adam_step == 3
    assert inner_state.restore(path, RUN, 1, names, params, _adamw(params), run_instance="").adam_step == 3


def test_another_learners_state_is_ignored(saved, caplog):
    _refused(*saved, caplog, "it is learner 1's, this is learner 2", learner=2)


def test_another_models_state_is_ignored(saved, caplog):
    path, names, _ = saved
    _, other = _model()
    other[1] = torch.nn.Parameter(torch.zeros(6))
    _refused(path, names, other, caplog, "its model (names and shapes) is not this run's")


@pytest.mark.parametrize("change, reason", [
    (lambda t: t["0.exp_avg"].__setitem__((0, 0), float("nan")), "w's exp_avg holds NaN or Inf"),
    (lambda t: t["1.exp_avg_sq"].__setitem__(2, -1.0), "b's exp_avg_sq holds negative values"),
    # finite, but no gradients make it: AdamW's first step would throw w to about 1e19
    (lambda t: t["0.exp_avg"].__setitem__((1, 1), 1e20), "w's exp_avg reaches"),
    (lambda t: t.pop("1.exp_avg"), "it holds 3 tensors, not the 4 of this model's moments"),
    (lambda t: t.__setitem__("0.exp_avg", t["0.exp_avg"].double()), "w's exp_avg is torch.float64"),
])
def test_moments_adamw_cannot_hold_are_ignored(saved, caplog, change, reason):
    _rewrite(saved[0], tensor_change=change)
    _refused(*saved, caplog, reason)


@pytest.mark.parametrize("key, value, reason", [
    ("adam_step", "0", "its adam_step 0 is outside"),
    ("adam_step", str(1 << 62), "is outside"),
    ("schedule_step", "-1", "its schedule_step -1 is outside"),
    ("schedule_step", "three", "no whole number 'schedule_step'"),
    ("format", "9", "format '9', this version writes 1"),
])
def test_counts_out_of_range_are_ignored(saved, caplog, key, value, reason):
    _rewrite(saved[0], meta_change=lambda m: m.__setitem__(key, value))
    _refused(*saved, caplog, reason)


def test_a_file_that_is_not_safetensors_is_ignored(saved, caplog):
    saved[0].write_bytes(b"\x00" * 3)
    _refused(*saved, caplog, "not a safetensors file")


# ------------------------------------------------------------ the writer thread's rules
def _meta(path) -> dict:
    data = path.read_bytes()
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]


def test_a_snapshot_is_a_copy_that_later_steps_do_not_change(tmp_path):
    names, params = _model()
    opt = _adamw(params)
    _train(params, opt, 2, seed=1)
    snap = inner_state.snapshot(RUN, 1, names, params, opt, schedule_step=2)
    before = {k: v.clone() for k, v in snap.tensors.items()}
    _train(params, opt, 3, seed=2)
    assert all(torch.equal(snap.tensors[k], before[k]) for k in before)
    assert snap.meta["adam_step"] == "2"


def test_the_keeper_writes_the_newest_snapshot_and_drops_the_ones_it_overtook(tmp_path):
    names, params = _model()
    opt = _adamw(params)
    keeper = inner_state.Keeper(inner_state.path_for(tmp_path, 1), on_unsaved=pytest.fail)
    for k in range(1, 4):  # three offers before the writer runs: only the last is written
        _train(params, opt, 1, seed=k)
        keeper.offer(inner_state.snapshot(RUN, 1, names, params, opt, schedule_step=k))
    keeper.stopping.set()
    keeper.loop()  # on this thread: writes what waits, then returns since it is stopping
    assert keeper.written == 1
    assert _meta(keeper.path)["schedule_step"] == "3"
    fresh = _adamw(params)
    assert inner_state.restore(keeper.path, RUN, 1, names, params, fresh).adam_step == 3


def test_a_process_that_lost_its_id_writes_nothing_more_over_its_successors_file(tmp_path):
    """Superseded (another process took the learner id and restored from this file), the old
    process drops what waits and ignores later offers: its snapshot written on the way out
    replaced the successor's before."""
    names, params = _model()
    opt = _adamw(params)
    keeper = inner_state.Keeper(inner_state.path_for(tmp_path, 1), on_unsaved=pytest.fail)
    _train(params, opt, 1, seed=1)
    keeper.offer(inner_state.snapshot(RUN, 1, names, params, opt, schedule_step=1))
    keeper.abandon()
    keeper.offer(inner_state.snapshot(RUN, 1, names, params, opt, schedule_step=2))
    keeper.stopping.set()
    keeper.loop()
    assert keeper.written == 0 and not keeper.path.exists()


def test_a_disk_that_refuses_a_write_is_reported_and_the_next_snapshot_tries_again(tmp_path):
    names, params = _model()
    opt = _adamw(params)
    _train(params, opt, 1, seed=1)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the state folder should be")
    unsaved = []
    keeper = inner_state.Keeper(inner_state.path_for(blocked, 1), on_unsaved=unsaved.append)
    keeper.offer(inner_state.snapshot(RUN, 1, names, params, opt, schedule_step=1))
    keeper.stopping.set()
    keeper.loop()
    assert len(unsaved) == 1 and keeper.written == 0
    blocked.unlink()  # the disk is back
    keeper.offer(inner_state.snapshot(RUN, 1, names, params, opt, schedule_step=1))
    keeper.loop()
    assert keeper.written == 1 and keeper.path.exists()


def test_the_first_moment_bound_is_the_closed_form_and_no_gradients_break_it():
    """|exp_avg| <= C sqrt(exp_avg_sq), C = (1-b1) / sqrt((1-b2)(1-b1^2/b2)): 1.1650 at
    betas (0.9, 0.95), 7.27 at (0.9, 0.999); no bound where b1^2 >= b2. Gradients built to
    approach it (g_k proportional to (b1/b2)^(t-k): the Cauchy-Schwarz equality case) stay
    under it; torch's own AdamW moments are checked."""
    assert inner_state.first_moment_bound((0.9, 0.95)) == pytest.approx(0.1 / (0.05 * (1 - 0.81 / 0.95)) ** 0.5)
    assert inner_state.first_moment_bound((0.9, 0.95)) == pytest.approx(1.1650, abs=1e-4)
    assert inner_state.first_moment_bound((0.9, 0.999)) == pytest.approx(7.2703, abs=1e-4)
    assert inner_state.first_moment_bound((0.99, 0.9)) is None
    bound = inner_state.first_moment_bound((0.9, 0.95))
    p = torch.nn.Parameter(torch.zeros(3))
    opt = _adamw([p])
    t = 200
    for k in range(t):
        opt.zero_grad()
        p.grad = torch.tensor([1.0, -3e-20, 5.0]) * (0.9 / 0.95) ** (t - k)
        opt.step()
    st = opt.state[p]
    ratio = st["exp_avg"].abs() / st["exp_avg_sq"].sqrt()
    assert float(ratio[0]) == pytest.approx(bound, rel=1e-3)  # the equality case, reached
    assert bool((ratio <= bound * (1 + 1e-3)).all())
