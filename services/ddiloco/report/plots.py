"""The PNGs of ``ddiloco report``, drawn with matplotlib (the ``plot`` extra) off-screen."""

from __future__ import annotations

import pathlib

from ddiloco.report.series import RunSeries

WASTE_COLORS = {"merged": "#17803d", "lost_in_crash": "#c0262d", "refused_stale": "#e07b00",
                "restarting": "#7b4fc0", "waiting": "#9aa3b2"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def _mark_faults(ax, series: RunSeries) -> None:
    """A dashed red line at each fault, labelled once per label (the legend stays short)."""
    seen = set()
    for s, label in series.faults:
        ax.axvline(s, color="#c0262d", ls="--", lw=0.9, alpha=0.7, label=None if label in seen else label)
        seen.add(label)


def render(series: RunSeries, goodput: dict | None, out: pathlib.Path) -> list[pathlib.Path]:
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    # eval loss against tokens merged and against wall-clock
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    if series.evals:
        a.plot([e[2] / 1e6 for e in series.evals], [e[3] for e in series.evals], "o-", ms=3)
        b.plot([e[0] for e in series.evals], [e[3] for e in series.evals], "o-", ms=3)
    a.set(xlabel="tokens merged (M)", ylabel="eval loss", title="eval loss against tokens")
    b.set(xlabel="seconds since the first learner joined", ylabel="eval loss", title="eval loss against wall-clock")
    _mark_faults(b, series)
    if series.faults:
        b.legend(fontsize=7)
    save(fig, "eval_loss.png")

    # bytes per learner (one learner per datacenter) over time
    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    for i, (lid, points) in enumerate(sorted(series.bytes.items())):
        ax.plot([p[0] for p in points], [p[1] / 1e6 for p in points], color=f"C{i}", label=f"learner {lid} up")
        ax.plot([p[0] for p in points], [p[2] / 1e6 for p in points], color=f"C{i}", ls=":", label=f"learner {lid} down")
    _mark_faults(ax, series)
    ax.set(xlabel="seconds since the first learner joined", ylabel="MB (payload, cumulative)",
           title="bytes moved per learner / datacenter")
    if series.bytes or series.faults:
        ax.legend(fontsize=7, ncol=2)
    save(fig, "bytes.png")

    # merges over time and the staleness of the deltas they merged
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    a.step([m[0] for m in series.merges], list(range(1, len(series.merges) + 1)), where="post")
    _mark_faults(a, series)
    a.set(xlabel="seconds since the first learner joined", ylabel="merges", title="outer steps (cumulative)")
    stale = [x for m in series.merges for x in m[2]]
    xs = [m[0] for m in series.merges for _ in m[2]]
    b.scatter(xs, stale, s=6, alpha=0.6)
    b.set(xlabel="seconds since the first learner joined", ylabel="rounds", title=f"staleness of merged deltas ({len(stale)})")
    save(fig, "merges.png")

    # goodput and its waste buckets, the run and per learner
    if goodput is not None and goodput.get("goodput_accounting", {}).get("provisioned_s", 0) > 0:
        acc = goodput["goodput_accounting"]
        rows = [("run", acc["merged_s"], acc["waste_s"])]
        rows += [(f"learner {k}", v["merged_s"], v["waste_s"]) for k, v in sorted(acc["learners"].items(), key=lambda kv: int(kv[0]))]
        fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.5), dpi=110)
        for y, (name, merged, waste) in enumerate(rows):
            total = merged + sum(waste.values()) or 1.0
            left = 0.0
            for key, value in [("merged", merged), *waste.items()]:
                share = value / total
                ax.barh(y, share, left=left, color=WASTE_COLORS.get(key, "#555"), label=key.replace("_", " ") if y == 0 else None)
                left += share
        ax.set_yticks(range(len(rows)), [r[0] for r in rows])
        ax.invert_yaxis()
        ax.set(xlim=(0, 1), xlabel="share of provisioned learner time", title=f"goodput {goodput['goodput']:.1%} and waste")
        ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.25))
        save(fig, "goodput.png")
    return written
