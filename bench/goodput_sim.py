"""Goodput simulator benchmark: reproduce the published goodput table and time a month at 2.4M chips.

    PYTHONPATH=services python bench/goodput_sim.py            # full: writes bench/results/goodput_sim.{json,png}
    PYTHONPATH=services python bench/goodput_sim.py --quick    # seconds: CI smoke; writes only with --out-dir

Prints a markdown table (simulated vs published, per-cell error), the calibration, and the
wall time of one simulated month at 2.4M chips per method on one core.
"""

from __future__ import annotations

import os

# one core: keep any threaded numpy backend to a single thread
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
try:
    import ddiloco.simulate  # noqa: F401
except ModuleNotFoundError:  # not installed: run from the checkout
    sys.path.insert(0, str(ROOT / "services"))
sys.path.insert(0, str(ROOT / "bench"))

import common_bench as cb  # noqa: E402

from ddiloco.simulate import calibrate, model, report  # noqa: E402
from ddiloco.simulate.params import DAY, Params  # noqa: E402


def time_month(p: Params, chips: int = 2_400_000) -> dict[str, float]:
    """Seconds to simulate one 30-day span at ``chips`` chips, per method (one seed)."""
    month = p.replace(duration_s=30 * DAY)
    out: dict[str, float] = {}
    for name, method, learners in (("dp", "dp", None), ("elastic-dp", "elastic-dp", None),
                                   ("ddiloco-m8", "ddiloco", 8), ("ddiloco-m16", "ddiloco", 16)):
        t0 = time.process_time()
        model.simulate(method, chips, month, seed=0, learners=learners)
        out[name] = round(time.process_time() - t0, 4)
    out["all"] = round(sum(out.values()), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 simulated days, 2 seeds: a smoke run in seconds")
    ap.add_argument("--out-dir", type=Path, default=None, help="where to write goodput_sim.json/.png (full default: bench/results)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=None, help="seeds per cell (default 10; quick 2)")
    ap.add_argument("--days", type=float, default=None, help="simulated span (default 30; quick 3)")
    ap.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes in services/ or bench/ (marked dirty)")
    args = ap.parse_args(argv)
    # the goodput figures are simulated and do not depend on the machine, but the month's CPU
    # seconds do: git state and load average, as every bench records them
    prov = cb.start_provenance(args.allow_dirty or args.quick, "goodput_sim")

    repeats = args.repeats or (2 if args.quick else 10)
    days = args.days or (3.0 if args.quick else 30.0)
    out_dir = args.out_dir if args.out_dir is not None else (None if args.quick else ROOT / "bench" / "results")

    t0 = time.perf_counter()
    p = calibrate.calibrate(Params()).replace(duration_s=days * DAY)
    cells = report.run_grid(p, seed=args.seed, repeats=repeats)
    grid_s = time.perf_counter() - t0
    timing = time_month(p)

    print(f"## Goodput: simulated ({repeats} seeds x {days:g} days) vs published, points\n")
    print(report.markdown(cells))
    s = report.summary(cells)
    print(f"\nworst predicted cell: {s['worst_cell']} ({100 * s['max_abs_error_predicted']:.1f} points); "
          f"all within 3 points: {s['within_tolerance']}")
    for cell, v in s["seed_figures"].items():
        print(f"seed figure {cell}: {100 * v['goodput']:.1f} vs {v['published'] * 100:.0f} ({100 * v['error']:+.1f})")
    print("\ncalibration (one cell per family):")
    for c in report.calibration_json(p):
        print(f"  {c['family']}: {c['constant']} = {c['value']:.3f} s on {c['cell']['method']} @ {c['cell']['chips']:,}")
    print("\n2.4M chips, one simulated month, one seed, CPU seconds on one core:")
    print("  " + ", ".join(f"{k} {v:.3f}" for k, v in timing.items()))
    print(f"grid: {len(cells)} cells x {repeats} seeds in {grid_s:.1f} s wall")

    if out_dir is not None:
        command = "PYTHONPATH=services python bench/goodput_sim.py" + (" --quick" if args.quick else "")
        report.write_json(out_dir / "goodput_sim.json", cells, p, command=command, seed=args.seed,
                          repeats=repeats, duration_days=days, timing_2p4m_month_cpu_s=timing,
                          sensitivity=calibrate.sensitivity(Params()), provenance=cb.finish_provenance(prov))
        print(f"wrote {out_dir / 'goodput_sim.json'}")
        if report.plot(out_dir / "goodput_sim.png", cells):
            print(f"wrote {out_dir / 'goodput_sim.png'}")
        else:
            print("matplotlib is not installed (pip install 'ddiloco[plot]'): skipped the PNG")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
