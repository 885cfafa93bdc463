"""What a delta may claim (``outer/admission.py``), in-process: each rule raises a typed
refusal with a message saying what was wrong; the gRPC codes are the servicer's
(``test_servicer_errors.py``). Over real processes: ``test_bad_input.py``."""

from __future__ import annotations

import pytest

from ddiloco.common import errors, merge
from ddiloco.common.config import RunConfig
from ddiloco.v1 import common_pb2
from ddiloco.outer import admission
from ddiloco.outer.records import Fragment


def test_a_delta_of_another_run_is_a_failed_precondition():
    with pytest.raises(errors.FailedPrecondition, match="for run 'other'"):
        admission.check_address(RunConfig(run_id="this"), "other", 1, 0, 1)


@pytest.mark.parametrize("seq, fragment, message", [(0, 0, "start at 1"), (1, 2, "fragment 2 does not exist")])
def test_a_sequence_below_one_or_a_missing_fragment_is_invalid(seq, fragment, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        admission.check_address(RunConfig(run_id="r"), "r", seq, fragment, 2)


def test_a_sequence_already_accepted_already_exists_and_a_jump_is_invalid():
    with pytest.raises(errors.AlreadyExists, match="already accepted"):
        admission.check_sequence(3, 5, last_accepted=5)
    with pytest.raises(errors.InvalidArgument, match="jumps"):
        admission.check_sequence(3, 6 + admission.MAX_SEQ_JUMP, last_accepted=5)
    admission.check_sequence(3, 5 + admission.MAX_SEQ_JUMP, last_accepted=5)


def _spec(name, shape, dtype="float32"):
    return common_pb2.TensorSpec(name=name, shape=list(shape), dtype=dtype)


@pytest.mark.parametrize(
    "specs, message",
    [
        ([_spec("w", (2, 3))], "has 1 tensors, fragment 0 has 2"),
        ([_spec("v", (2, 3)), _spec("b", (3,))], "'v' where 'w' was expected"),
        ([_spec("w", (3, 2)), _spec("b", (3,))], r"shape \(3, 2\), expected \(2, 3\)"),
        ([_spec("w", (2, 3)), _spec("b", (3,), "float16")], "dtype 'float16'"),
    ],
)
def test_tensors_must_be_the_fragments_by_name_shape_and_dtype(specs, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        admission.check_tensors(0, specs, ["w", "b"], [(2, 3), (3,)])


def _fragment_at_version_2() -> Fragment:
    frag = Fragment(0, [0], merge.WorkClockNesterov())
    for step in (1, 2):
        frag.tokens_merged = step * 1000
        frag.publish_version({})
    return frag


def test_staleness_is_discounted_by_one_over_one_plus_rounds_then_refused():
    frag = _fragment_at_version_2()
    assert admission.check_staleness(frag, 2, 0, 0, round_tokens=1000, max_rounds=4) == 1.0
    assert admission.check_staleness(frag, 1, 0, 0, round_tokens=1000, max_rounds=4) == pytest.approx(0.5)
    assert admission.check_staleness(frag, 0, 0, 0, round_tokens=1000, max_rounds=4) == pytest.approx(1 / 3)
    # its own work merged since its base is already in its local state: not staleness
    assert admission.check_staleness(frag, 0, 0, 1000, round_tokens=1000, max_rounds=4) == pytest.approx(0.5)
    with pytest.raises(errors.FailedPrecondition, match="2.00 rounds .* bound 1"):
        admission.check_staleness(frag, 0, 0, 0, round_tokens=1000, max_rounds=1)


def test_a_base_newer_than_the_fragment_or_no_longer_tracked_is_refused():
    frag = _fragment_at_version_2()
    with pytest.raises(errors.FailedPrecondition, match="newer than fragment 0's version 2"):
        admission.check_staleness(frag, 3, 0, 0, round_tokens=1000, max_rounds=4)
    frag.prune_versions(max_staleness_rounds=0, round_tokens=500)
    with pytest.raises(errors.FailedPrecondition, match="no longer tracked"):
        admission.check_staleness(frag, 0, 0, 0, round_tokens=1000, max_rounds=4)


@pytest.mark.parametrize("name", ["int8", "int4", "fp32"])
def test_a_declared_payload_is_at_most_what_the_fragment_encodes_to(name):
    import numpy as np

    from ddiloco.common import codec
    from ddiloco.common.wire import payload_info

    shapes = [(300, 70), (70,)]
    rng = np.random.default_rng(0)
    enc = codec.encode([(f"t{i}", rng.normal(size=s).astype(np.float32)) for i, s in enumerate(shapes)], name, 64)
    info = payload_info(enc)
    admission.check_payload_size(0, info, shapes)  # a real encoding passes
    info.payload_bytes = codec.payload_bound(codec.raw_size(name, 64, enc.specs))
    admission.check_payload_size(0, info, shapes)  # so does the bound itself
    info.payload_bytes += 1
    with pytest.raises(errors.InvalidArgument, match=f"fragment 0 in {name} .* takes at most"):
        admission.check_payload_size(0, info, shapes)


@pytest.mark.parametrize("codec_id, block, message", [
    (77, 64, "unknown codec 77"), (2, 0, "block size 0"), (2, 63, "block size 63"),
    (2, (1 << 20) + 2, "block size 1048578 is not an even number from 2 to 1048576"),
])
def test_a_header_with_an_unknown_codec_or_a_block_no_run_uses_is_refused_before_any_size_arithmetic(codec_id, block, message):
    info = common_pb2.PayloadInfo(codec=codec_id, block_size=block, payload_bytes=10)
    with pytest.raises(errors.InvalidArgument, match=message):
        admission.check_payload_size(0, info, [(10,)])


@pytest.mark.parametrize("align, sync, longest", [(True, False, 30), (False, False, 20), (True, True, 20)])
def test_one_window_as_long_as_phase_alignment_makes_it_is_admitted_even_without_coalescing(align, sync, longest):
    """Alignment lengthens a window by up to H/2 and the uploader never splits one: with
    --max-coalesce-windows 1 the 30-step window of H = 20 was refused, and the learner that
    sent it exited on INVALID_ARGUMENT."""
    cfg = RunConfig(run_id="r")
    cfg.learner.inner_steps, cfg.learner.max_coalesce_windows = 20, 1
    cfg.learner.align_windows, cfg.learner.sync = align, sync
    step_weight = cfg.learner.batch_size * cfg.model.context
    admission.check_work(cfg, longest * step_weight, longest, 1.0, step_weight)
    with pytest.raises(errors.InvalidArgument, match=f"outside \\[1, {longest}\\]"):
        admission.check_work(cfg, (longest + 1) * step_weight, longest + 1, 1.0, step_weight)
    cfg.learner.max_coalesce_windows = 4  # coalescing allows more than one lengthened window
    admission.check_work(cfg, 80 * step_weight, 80, 1.0, step_weight)


@pytest.mark.parametrize("loss", [float("nan"), float("inf")])
def test_a_non_finite_window_loss_is_invalid(loss):
    cfg = RunConfig(run_id="r")
    step_weight = cfg.learner.batch_size * cfg.model.context
    admission.check_work(cfg, 5 * step_weight, 5, 1.0, step_weight, loss=2.5)
    with pytest.raises(errors.InvalidArgument, match="is not finite"):
        admission.check_work(cfg, 5 * step_weight, 5, 1.0, step_weight, loss=loss)
