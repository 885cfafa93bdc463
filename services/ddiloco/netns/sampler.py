"""Per-datacenter link use from the kernel's byte counters, in 1-second windows.

The counters read are those of each link's *hub* end: its tx_bytes is what the hub sent to
the datacenter (downloads, and dc<->dc traffic bound for it), its rx_bytes what the datacenter
sent (uploads). Each direction is shaped on its own, so use is reported per direction, and a
datacenter's ``peak_mbps``/``avg_mbps`` are those of its busier direction.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from ddiloco.common.metrics import MetricsLog
from ddiloco.netns.topology import Plan, in_namespace

MBIT = 1e6


@dataclass
class Window:
    t: float  # wall time at the window's end
    seconds: float
    up: list[int]  # bytes per datacenter, datacenter -> hub
    down: list[int]  # bytes per datacenter, hub -> datacenter


@dataclass
class Samples:
    devs: list[str]
    first: dict | None = None
    last: dict | None = None
    windows: list[Window] = field(default_factory=list)


class LinkSampler:
    """Runs the counters helper in the hub namespace and turns its readings into windows
    (``link_sample`` events in metrics.jsonl as they come)."""

    def __init__(self, plan: Plan, metrics: MetricsLog | None, env: dict[str, str], interval: float = 1.0) -> None:
        self.plan = plan
        self.metrics = metrics
        self.env = env
        self.interval = interval
        self.samples = Samples([d.hub_dev for d in plan.datacenters])
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._started = threading.Event()

    def start(self, timeout: float = 60.0) -> None:
        cmd = [*in_namespace(self.plan.hub_namespace), sys.executable, "-m", "ddiloco.netns.counters",
               "--interval", str(self.interval), *self.samples.devs]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=self.env)
        self._thread = threading.Thread(target=self._read, name="link-sampler", daemon=True)
        self._thread.start()
        # the start reading must exist before any traffic, or it would go uncounted
        if not self._started.wait(timeout) or self.samples.first is None:
            self.stop()
            raise RuntimeError(f"link counter helper did not start: {self._error or 'no reading'}")

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        prev = None
        for line in self._proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if prev is None:
                self.samples.first = rec
                self._started.set()
            else:
                self._window(prev, rec)
            self.samples.last = rec
            prev = rec
        if self.samples.first is None:
            self._error = (self._proc.stderr.read() if self._proc.stderr else "").strip()[-2000:]
        self._started.set()

    def _window(self, a: dict, b: dict) -> None:
        dt = b["m"] - a["m"]
        if dt <= 0:
            return
        up, down = [], []
        for dev in self.samples.devs:
            (tx0, rx0), (tx1, rx1) = a["c"][dev], b["c"][dev]
            down.append(tx1 - tx0)
            up.append(rx1 - rx0)
        w = Window(t=b["t"], seconds=dt, up=up, down=down)
        self.samples.windows.append(w)
        if self.metrics is not None:
            for link, u, d in zip(self.plan.datacenters, up, down):
                self.metrics.event(
                    "link_sample", datacenter=link.index, dev=link.hub_dev, window_s=round(dt, 4),
                    up_bytes=u, down_bytes=d, up_mbps=round(u * 8 / dt / MBIT, 4), down_mbps=round(d * 8 / dt / MBIT, 4),
                )

    def stop(self, timeout: float = 30.0) -> None:
        """Take the end-of-run reading and stop the helper."""
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()  # the helper's cue for its final reading
            except BrokenPipeError:
                pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if self._thread is not None:
            self._thread.join(timeout)
        self._proc = None


Span = tuple[float, float]


def summarize(plan: Plan, samples: Samples, span: Span | dict[int, Span] | None = None) -> dict:
    """Start/end counters and per-datacenter average and peak use.

    ``span`` (wall times; one for all datacenters, or one per datacenter index) restricts the
    average and the peak to the windows lying wholly inside it, the training span, so that
    start-up, the one-off full download at join and the drain at the end neither dilute the
    average nor set the peak. Byte totals are always whole-run."""
    first, last = samples.first, samples.last
    if first is None or last is None:
        raise ValueError("no counter readings")
    interval = samples_interval(samples.windows)

    def inside(index: int) -> list[Window]:
        s = span.get(index) if isinstance(span, dict) else span
        if s is None:
            return samples.windows
        chosen = [w for w in samples.windows if w.t - w.seconds >= s[0] - 1e-3 and w.t <= s[1] + 1e-3]
        return chosen or samples.windows

    out = []
    for i, link in enumerate(plan.datacenters):
        windows = inside(i)
        seconds = sum(w.seconds for w in windows)
        dev = link.hub_dev
        (tx0, rx0), (tx1, rx1) = first["c"][dev], last["c"][dev]
        up_total, down_total = rx1 - rx0, tx1 - tx0
        up_span = sum(w.up[i] for w in windows)
        down_span = sum(w.down[i] for w in windows)

        def rate(b: float, s: float) -> float:
            return round(b * 8 / s / MBIT, 4) if s > 0 else 0.0

        peak_up = max((rate(w.up[i], w.seconds) for w in windows), default=0.0)
        peak_down = max((rate(w.down[i], w.seconds) for w in windows), default=0.0)
        avg_up, avg_down = rate(up_span, seconds), rate(down_span, seconds)
        out.append({
            "datacenter": link.index,
            "namespace": link.namespace,
            "hub_dev": dev,
            "dc_dev": link.dc_dev,
            "hub_address": link.hub_address,
            "address": link.address,
            "rate_mbit": None if link.rate_bits is None else link.rate_bits / MBIT,
            "counters_start": {"tx_bytes": tx0, "rx_bytes": rx0},
            "counters_end": {"tx_bytes": tx1, "rx_bytes": rx1},
            "bytes_up": up_total,
            "bytes_down": down_total,
            "bytes_total": up_total + down_total,
            "avg_up_mbps": avg_up,
            "avg_down_mbps": avg_down,
            "peak_up_mbps": peak_up,
            "peak_down_mbps": peak_down,
            "avg_mbps": max(avg_up, avg_down),
            "peak_mbps": max(peak_up, peak_down),
            "windows": len(windows),
            "span_seconds": round(seconds, 3),
            "span": [round(windows[0].t - windows[0].seconds, 3), round(windows[-1].t, 3)] if windows else None,
        })
    return {
        "counted_at": "hub end of each datacenter link: tx_bytes = hub->dc (down), rx_bytes = dc->hub (up)",
        "source": "/sys/class/net/<dev>/statistics/{tx,rx}_bytes inside the hub namespace",
        "window_s": round(interval, 4),
        "windows": len(samples.windows),
        "span_rule": "windows wholly inside each datacenter's training span (its first training step until draining starts)"
        if span is not None else "every window",
        "span_seconds": max((d["span_seconds"] for d in out), default=0.0),
        "datacenters": out,
        "bytes_total": sum(d["bytes_total"] for d in out),
        "worst_avg_mbps": max((d["avg_mbps"] for d in out), default=0.0),
        "worst_peak_mbps": max((d["peak_mbps"] for d in out), default=0.0),
    }


def series(samples: Samples) -> dict:
    """Link use over time, for plots: wall times and Mbit/s per datacenter and direction."""
    ws = samples.windows
    n = len(samples.devs)
    return {
        "t": [round(w.t, 3) for w in ws],
        "up_mbps": [[round(w.up[i] * 8 / w.seconds / MBIT, 4) for w in ws] for i in range(n)],
        "down_mbps": [[round(w.down[i] * 8 / w.seconds / MBIT, 4) for w in ws] for i in range(n)],
    }


def samples_interval(windows: list[Window]) -> float:
    if not windows:
        return 0.0
    lengths = sorted(w.seconds for w in windows)
    return lengths[len(lengths) // 2]
