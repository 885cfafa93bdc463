"""One run's namespace topology over its lifetime: claim names, build, sample the links,
tear down, and make sure tear-down happens on a normal exit, on Ctrl-C, on SIGTERM/SIGHUP
and on an exception. Only SIGKILL (or a power cut) can leave parts behind; the run's marker
file lets ``ddiloco netns cleanup`` remove them."""

from __future__ import annotations

import atexit
import os
import pathlib

import ddiloco
from ddiloco.common.interrupts import StopSignals
from ddiloco.common.metrics import MetricsLog
from ddiloco.netns import registry
from ddiloco.netns import topology as T
from ddiloco.netns.sampler import LinkSampler, Samples, Span, summarize
from ddiloco.wan.profiles import Profile, get_profile


def package_env() -> dict[str, str]:
    """The environment for child processes, able to import ddiloco from a plain checkout."""
    env = dict(os.environ)
    src = str(pathlib.Path(ddiloco.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class NetnsSession:
    def __init__(
        self,
        profile: str | Profile,
        datacenters: int,
        *,
        qdisc: str = "tbf",
        out: pathlib.Path | None = None,
        state_dir: pathlib.Path = registry.DEFAULT_STATE_DIR,
        sample_interval: float = 1.0,
    ) -> None:
        self.profile = profile if isinstance(profile, Profile) else get_profile(profile)
        self.datacenters = datacenters
        self.qdisc = qdisc
        self.out = out
        self.state_dir = state_dir
        self.sample_interval = sample_interval
        self.plan: T.Plan | None = None
        self.built: T.Built | None = None
        self.sampler: LinkSampler | None = None
        self._closed = False
        self._signals: StopSignals | None = None

    # --- lifetime ---------------------------------------------------------------------

    def __enter__(self) -> "NetnsSession":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        T.require_root()
        self.plan = registry.claim(self.profile, self.datacenters, self.qdisc, str(self.out or ""), self.state_dir)
        self._guard()
        try:
            self.built = T.build(self.plan)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._closed or self.plan is None:
            return
        if self._signals is not None:
            self._signals.stopping()  # a second Ctrl-C must not interrupt the tear-down itself
        try:
            if self.sampler is not None:
                self.sampler.stop()
            registry.release(self.plan, self.state_dir)
            self._closed = True
        finally:
            self._unguard()

    def _guard(self) -> None:
        """Tear down at exit, and turn SIGINT/SIGTERM/SIGHUP into KeyboardInterrupt: unwinding
        through the callers' finally blocks stops services in order, then tears down."""
        atexit.register(self.close)
        self._signals = StopSignals().__enter__()

    def _unguard(self) -> None:
        atexit.unregister(self.close)
        if self._signals is not None:
            self._signals.__exit__(None, None, None)
            self._signals = None

    # --- where things run -------------------------------------------------------------

    def _require_plan(self) -> T.Plan:
        if self.plan is None or self.built is None:
            raise RuntimeError("the topology is not built; call open() first")
        return self.plan

    @property
    def hub_wrap(self) -> list[str]:
        return T.in_namespace(self._require_plan().hub_namespace)

    @property
    def hub_address(self) -> str:
        return self._require_plan().hub_address

    def dc_wrap(self, index: int) -> list[str]:
        return T.in_namespace(self._require_plan().datacenters[index].namespace)

    def dc_address(self, index: int) -> str:
        return self._require_plan().datacenters[index].address

    # --- link counters ----------------------------------------------------------------

    def start_sampling(self, metrics_path: pathlib.Path | None) -> None:
        plan = self._require_plan()
        metrics = MetricsLog(metrics_path, "netns") if metrics_path is not None else None
        self.sampler = LinkSampler(plan, metrics, package_env(), self.sample_interval)
        self.sampler.start()

    def stop_sampling(self) -> Samples:
        if self.sampler is None:
            raise RuntimeError("sampling was not started")
        self.sampler.stop()
        return self.sampler.samples

    def links(self, span: Span | dict[int, Span] | None = None) -> dict:
        """The ``links`` section of report.json: topology, shaping as read back from the
        kernel, and the counters' summary (call after stop_sampling)."""
        plan = self._require_plan()
        if self.sampler is None:
            raise RuntimeError("sampling was not started")
        summary = summarize(plan, self.sampler.samples, span)
        assert self.built is not None
        for d, (down, up) in zip(summary["datacenters"], self.built.shaping):
            d["shaping"] = {
                "hub_egress": {"qdisc": down.kind, "rate_bits": down.rate_bits},
                "dc_egress": {"qdisc": up.kind, "rate_bits": up.rate_bits},
            }
        return {
            "topology": "netns",
            "profile": plan.profile,
            "qdisc": plan.qdisc,
            "prefix": plan.prefix,
            "hub": {"namespace": plan.hub_namespace, "address": plan.hub_address},
            **summary,
        }


def describe(plan: T.Plan) -> str:
    lines = [f"hub {plan.hub_namespace} {plan.hub_address} (management link {plan.root_dev} {plan.root_address})"]
    for d in plan.datacenters:
        rate = "unshaped" if d.rate_bits is None else f"{d.rate_bits / 1e6:g} Mbit/s each way"
        lines.append(f"  dc{d.index} {d.namespace} {d.address} via {d.hub_address} ({rate}, {plan.qdisc})")
    return "\n".join(lines)

