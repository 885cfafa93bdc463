"""``ddiloco simulate``: goodput of data-parallel, elastic data-parallel and Decoupled
DiLoCo training under chip failures, at one size or over the published grid."""

from __future__ import annotations

import argparse
import json
import math
import sys

from ddiloco.simulate.params import DAY, HOUR, Params

_D = Params()
# One draw is bounded by model.MAX_PERIODS, the memory of its arrays; --repeats multiplies
# the draws (and --table by its 20 cells), and --repeats 1000000000 ran until killed. The
# whole command is bounded in the same count: ten draws at the per-draw limit, a few
# minutes (a draw of 20 million periods takes about 10 s on one core).
MAX_TOTAL_PERIODS = 300_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    size = parser.add_argument_group("size")
    size.add_argument("--chips", type=int, default=1_200_000, help="total chips (default 1,200,000)")
    size.add_argument("--learners", type=int, default=None, help="Decoupled DiLoCo learners M (default 8)")
    size.add_argument("--chips-per-learner", type=int, default=None, help="alternative to --learners: chips in each learner")
    m = parser.add_argument_group("failure and recovery model (defaults: the calibrated constants)")
    m.add_argument("--mtbi-hours", type=float, default=_D.mtbi_s / HOUR, help="per-chip mean time between interruptions, hours (default 8760 = 1 year; 'inf' for none)")
    m.add_argument("--restart-s", type=float, default=_D.restart_s, help="data-parallel: stall after any failure (default %(default)s)")
    m.add_argument("--checkpoint-chip-s", type=float, default=_D.checkpoint_chip_s, help="data-parallel: chip-seconds to write one checkpoint; a save stalls the job for this / chips (default %(default)s)")
    m.add_argument("--checkpoint-interval-s", type=float, default=None, help="data-parallel: work between checkpoints (default: the optimum for the failure rate)")
    m.add_argument("--rescale-s", type=float, default=_D.rescale_s, help="elastic data-parallel: stall of all running chips per failure (default %(default)s)")
    m.add_argument("--slice-chips", type=int, default=_D.slice_chips, help="elastic data-parallel: chips dropped with a failure (default %(default)s)")
    m.add_argument("--repair-h", type=float, default=_D.repair_s / HOUR, help="elastic data-parallel: hours before a dropped slice returns (default %(default)s)")
    m.add_argument("--recovery-s", type=float, default=_D.recovery_s, help="Decoupled DiLoCo: time a failed learner is out (default %(default)s)")
    m.add_argument("--step-cv", type=float, default=_D.step_cv, help="coefficient of variation of a chip's step time; synchronous groups wait for the slowest chip (default %(default)s)")
    run = parser.add_argument_group("run")
    run.add_argument("--days", type=float, default=_D.duration_s / DAY, help="simulated span in days (default %(default)s)")
    run.add_argument("--seed", type=int, default=0, help="first seed (default %(default)s)")
    run.add_argument("--repeats", type=int, default=8, help="seeds seed..seed+repeats-1, for the 95%% interval (default %(default)s)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    out.add_argument("--table", action="store_true", help="ignore --chips/--learners: run the published grid and compare")


def params_from(args: argparse.Namespace) -> Params:
    return Params(
        mtbi_s=math.inf if math.isinf(args.mtbi_hours) else args.mtbi_hours * HOUR,
        restart_s=args.restart_s,
        checkpoint_chip_s=args.checkpoint_chip_s,
        checkpoint_interval_s=args.checkpoint_interval_s,
        rescale_s=args.rescale_s,
        slice_chips=args.slice_chips,
        repair_s=args.repair_h * HOUR,
        recovery_s=args.recovery_s,
        step_cv=args.step_cv,
        duration_s=args.days * DAY,
    )


def learners_from(args: argparse.Namespace) -> int:
    if args.chips < 1:
        raise ValueError("--chips must be >= 1")
    if args.chips_per_learner is not None:
        if args.chips_per_learner < 1 or args.chips % args.chips_per_learner:
            raise ValueError("--chips-per-learner must divide --chips")
        m = args.chips // args.chips_per_learner
        if args.learners is not None and args.learners != m:
            raise ValueError(f"--learners {args.learners} contradicts --chips-per-learner ({m} learners)")
        return m
    m = 8 if args.learners is None else args.learners
    if not 1 <= m <= args.chips:
        raise ValueError("--learners must be between 1 and --chips")
    return m


def _draw(units: int, largest: int, down_s: float, p: Params) -> tuple[float, float]:
    """(periods, failures) one draw lays out for ``units`` failure units of up to ``largest``
    chips: the count model.renewal_timeline limits, and the failures its error names."""
    rate = p.failure_rate(largest)
    if rate <= 0:
        return float(units), 0.0
    cycle = 1.0 / rate + down_s
    expected = p.duration_s / cycle if cycle > 0 else math.inf
    if not math.isfinite(expected):
        return math.inf, math.inf
    return units * float(math.ceil(expected + 6.0 * math.sqrt(expected) + 8)), units * expected


def work(method: str, chips: int, learners: int | None, p: Params) -> tuple[float, float]:
    """(periods, failures) of one draw of ``method``, counted without drawing (nor making
    an array per unit: --chips 10^12 at --slice-chips 1 is counted as fast as the default)."""
    if method == "dp":
        return _draw(1, chips, p.restart_s, p)
    if method == "elastic-dp":
        return _draw(-(-chips // p.slice_chips), min(chips, p.slice_chips), p.repair_s, p)
    return _draw(learners, -(-chips // learners), p.recovery_s, p)


def check_work(args: argparse.Namespace, p: Params, learners: int) -> None:
    """Refuse, before the first draw, a command whose draws together exceed
    MAX_TOTAL_PERIODS."""
    from ddiloco.simulate import published as pub

    if args.table:
        cells = [(*pub.split_row(row), n) for row in pub.TABLE for n in pub.CHIPS]
    else:
        cells = [("dp", None, args.chips), ("elastic-dp", None, args.chips), ("ddiloco", learners, args.chips)]
    periods = failures = 0.0
    for method, m, chips in cells:
        a, b = work(method, chips, m, p)
        periods, failures = periods + a, failures + b
    if periods * args.repeats > MAX_TOTAL_PERIODS:
        if not math.isfinite(failures):
            raise ValueError(f"--days: {args.days:g} days at --mtbi-hours {args.mtbi_hours:g} make more failures than "
                             f"can be simulated (limit {MAX_TOTAL_PERIODS:,} over all seeds)")
        raise ValueError(
            f"--repeats: {args.repeats:,} seeds of {args.days:g} days make about {failures * args.repeats:,.0f} failures to "
            f"simulate (limit {MAX_TOTAL_PERIODS:,} over all seeds); use fewer seeds, a shorter --days or the closed form"
        )


def main(args: argparse.Namespace) -> int:
    from ddiloco.simulate import report

    try:
        p = params_from(args)
        learners = learners_from(args)
        if args.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        check_work(args, p, learners)
    except ValueError as exc:
        print(f"ddiloco simulate: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.table:
            cells = report.run_grid(p, seed=args.seed, repeats=args.repeats)
            text = (json.dumps({"summary": report.summary(cells), "rows": [c.to_json() for c in cells]})
                    if args.json else report.markdown(cells))
        else:
            result = report.at_size(args.chips, learners, p, seed=args.seed, repeats=args.repeats)
            text = json.dumps(result) if args.json else report.size_markdown(result)
    except ValueError as exc:
        print(f"ddiloco simulate: error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0
