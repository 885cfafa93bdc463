"""Run the simulator over the published grid and render it: markdown, JSON, PNG."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ddiloco.simulate import calibrate as cal
from ddiloco.simulate import closed_form as cf
from ddiloco.simulate import model
from ddiloco.simulate import published as pub
from ddiloco.simulate.params import DAY, HOUR, Params


@dataclasses.dataclass(frozen=True)
class Cell:
    method: str  # a published row: 'dp', 'elastic-dp', 'ddiloco-m8', 'ddiloco-m16'
    chips: int
    goodput: float  # simulated mean over the seeds
    ci95: tuple[float, float]
    closed_form: float
    published: float | None
    calibrated: bool

    @property
    def error(self) -> float | None:
        return None if self.published is None else self.goodput - self.published

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "chips": self.chips,
            "goodput": round(self.goodput, 5),
            "published": self.published,
            "calibrated": self.calibrated,
            "error": None if self.error is None else round(self.error, 5),
            "ci95": [round(self.ci95[0], 5), round(self.ci95[1], 5)],
            "closed_form": round(self.closed_form, 5),
        }


def run_cell(row: str, chips: int, p: Params, seed: int, repeats: int) -> Cell:
    method, learners = pub.split_row(row)
    est = model.estimate(method, chips, p, seed=seed, repeats=repeats, learners=learners)
    return Cell(
        method=row,
        chips=chips,
        goodput=est.mean,
        ci95=(est.lo, est.hi),
        closed_form=cf.goodput(method, chips, p, learners),
        published=pub.published(row, chips),
        calibrated=cal.is_calibration_cell(row, chips),
    )


def run_grid(p: Params, seed: int = 0, repeats: int = 10, chips=pub.CHIPS, rows=tuple(pub.TABLE)) -> list[Cell]:
    return [run_cell(row, n, p, seed, repeats) for row in rows for n in chips]


def chips_label(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def markdown(cells: list[Cell]) -> str:
    """Pivot table: one row per method, one column per size; each cell is
    'simulated vs published (error)', in goodput points; calibration cells are marked."""
    sizes = sorted({c.chips for c in cells})
    rows = list(dict.fromkeys(c.method for c in cells))
    by = {(c.method, c.chips): c for c in cells}
    lines = ["| method | " + " | ".join(chips_label(n) for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for row in rows:
        out = []
        for n in sizes:
            c = by.get((row, n))
            if c is None:
                out.append("")
            elif c.published is None:
                out.append(f"{100 * c.goodput:.1f}")
            elif c.calibrated:
                out.append(f"**{100 * c.goodput:.1f}** vs {100 * c.published:.0f} (calibrated)")
            else:
                out.append(f"{100 * c.goodput:.1f} vs {100 * c.published:.0f} ({100 * c.error:+.1f})")
        lines.append(f"| {row} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def summary(cells: list[Cell]) -> dict:
    """Worst predicted error, and the error at each seed figure."""
    predicted = [c for c in cells if c.published is not None and not c.calibrated]
    by = {(c.method, c.chips): c for c in cells}
    worst = max(predicted, key=lambda c: abs(c.error), default=None)
    return {
        "max_abs_error_predicted": None if worst is None else round(abs(worst.error), 5),
        "worst_cell": None if worst is None else f"{worst.method}@{worst.chips}",
        "within_tolerance": all(abs(c.error) <= pub.TOLERANCE for c in predicted),
        "seed_figures": {
            f"{row}@{n}": {"goodput": round(by[(row, n)].goodput, 5), "published": v, "error": round(by[(row, n)].goodput - v, 5)}
            for (row, n), v in pub.SEED.items()
            if (row, n) in by
        },
    }


def params_json(p: Params) -> dict:
    d = dataclasses.asdict(p)
    d["mtbi_hours"] = p.mtbi_s / HOUR
    d["duration_days"] = p.duration_s / DAY
    return d


def calibration_json(p: Params) -> list[dict]:
    return [
        {"family": c.family, "cell": {"method": c.row, "chips": c.chips}, "constant": c.constant, "value": getattr(p, c.constant)}
        for c in cal.CALIBRATIONS
    ]


def write_json(path: Path, cells: list[Cell], p: Params, **meta) -> None:
    doc = {
        **meta,
        "params": params_json(p),
        "calibration": calibration_json(p),
        "summary": summary(cells),
        "rows": [c.to_json() for c in cells],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def plot(path: Path, cells: list[Cell]) -> bool:
    """Goodput against chips, one line per method, published points marked. Returns
    False (and writes nothing) when matplotlib, the optional 'plot' extra, is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for i, row in enumerate(dict.fromkeys(c.method for c in cells)):
        mine = sorted((c for c in cells if c.method == row), key=lambda c: c.chips)
        color = f"C{i}"
        xs = [c.chips for c in mine]
        ax.plot(xs, [100 * c.goodput for c in mine], "-", color=color, label=f"{row} (simulated)")
        ax.fill_between(xs, [100 * c.ci95[0] for c in mine], [100 * c.ci95[1] for c in mine], color=color, alpha=0.2)
        pubs = [(c.chips, 100 * c.published) for c in mine if c.published is not None]
        if pubs:
            ax.plot(*zip(*pubs), "o", mfc="none", color=color, ms=7)
        cals = [(c.chips, 100 * c.goodput) for c in mine if c.calibrated]
        if cals:
            ax.plot(*zip(*cals), "*", color=color, ms=11)
    ax.plot([], [], "ko", mfc="none", label="published")
    ax.plot([], [], "k*", label="calibration cell")
    ax.set_xscale("log")
    ax.set_xticks(sorted({c.chips for c in cells}), [chips_label(n) for n in sorted({c.chips for c in cells})])
    ax.minorticks_off()
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 102)
    ax.set_title("Goodput under failures (per-chip MTBI 1 year)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def at_size(chips: int, learners: int, p: Params, seed: int = 0, repeats: int = 8) -> dict:
    """Goodput of every method at one size: what ``ddiloco simulate --json`` prints."""
    runs = {"dp": ("dp", None), "elastic-dp": ("elastic-dp", None), f"ddiloco-m{learners}": ("ddiloco", learners)}
    goodput, ci, closed = {}, {}, {}
    for name, (method, m) in runs.items():
        est = model.estimate(method, chips, p, seed=seed, repeats=repeats, learners=m)
        goodput[name] = round(est.mean, 6)
        ci[name] = [round(est.lo, 6), round(est.hi, 6)]
        closed[name] = round(cf.goodput(method, chips, p, m), 6)
    published = {name: pub.published(name, chips) for name in runs if pub.published(name, chips) is not None}
    return {
        "chips": chips,
        "learners": learners,
        "chips_per_learner": chips / learners if chips % learners else chips // learners,
        "seed": seed,
        "repeats": repeats,
        "goodput": goodput,
        "ci95": ci,
        "closed_form": closed,
        "published": published,
        "params": params_json(p),
    }


def size_markdown(result: dict) -> str:
    lines = [
        f"goodput at {result['chips']:,} chips, {result['learners']} learners, "
        f"{result['params']['duration_days']:g} days, {result['repeats']} seeds from {result['seed']}",
        "",
        "| method | goodput % | 95% CI | closed form % | published % |",
        "|---|---|---|---|---|",
    ]
    for name, g in result["goodput"].items():
        lo, hi = result["ci95"][name]
        p = result["published"].get(name)
        lines.append(
            f"| {name} | {100 * g:.2f} | {100 * lo:.2f}–{100 * hi:.2f} | {100 * result['closed_form'][name]:.2f} | "
            f"{'' if p is None else f'{100 * p:.0f}'} |"
        )
    return "\n".join(lines)
