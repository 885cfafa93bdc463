"""The live progress of ``ddiloco run`` on stderr: on a terminal a tqdm bar over the run's
budget (tokens when ``--max-tokens`` is set, else seconds) with the loss, version, bytes and
live learners beside it; anything else (a log file, CI) keeps the plain line every 10 s,
which reads well in a file where a redrawn bar would not."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import grpc

from ddiloco.common.rpc import channel
from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc, outer_pb2, outer_pb2_grpc


@dataclass
class Snapshot:
    elapsed_s: float
    state: str
    tokens: int
    loss: str  # formatted; "-" before the first evaluation
    version: str
    up_bytes: int
    down_bytes: int
    alive: int
    members: int


def snapshot(m: coordinator_pb2.Membership | None) -> Snapshot | None:
    """The run as the coordinator (membership) and the outer optimizer (status) see it now."""
    if m is None:
        return None
    version, loss = "-", "-"
    if m.outer_address:
        try:
            with channel(m.outer_address) as ch:
                st = outer_pb2_grpc.OuterOptimizerStub(ch).GetStatus(outer_pb2.StatusRequest(), timeout=2)
            version = str(st.version)
            loss = f"{st.last_eval_loss:.3f}" if st.last_eval_version or st.last_eval_loss else "-"
        except grpc.RpcError:
            pass
    return Snapshot(
        elapsed_s=m.elapsed_seconds,
        state=coordinator_pb2.RunState.Name(m.state).removeprefix("RUN_STATE_").lower(),
        tokens=sum(x.stats.tokens for x in m.members),
        loss=loss,
        version=version,
        up_bytes=sum(x.stats.bytes_uploaded for x in m.members),
        down_bytes=sum(x.stats.bytes_downloaded for x in m.members),
        alive=sum(1 for x in m.members if x.alive),
        members=len(m.members),
    )


def plain_line(s: Snapshot) -> str:
    return (
        f"[{s.elapsed_s:6.1f}s {s.state}] tokens {s.tokens / 1e6:6.2f}M  eval loss {s.loss}  version {s.version}  "
        f"up {s.up_bytes / 1e6:6.1f}MB down {s.down_bytes / 1e6:6.1f}MB  learners {s.alive}/{s.members}"
    )


def budget(coordinator_address: str) -> tuple[float, int] | None:
    """(max_seconds, max_tokens) of the run, from the coordinator; None if it does not answer."""
    try:
        with channel(coordinator_address) as ch:
            resp = coordinator_pb2_grpc.CoordinatorStub(ch).GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=2)
    except grpc.RpcError:
        return None
    cfg = json.loads(resp.config_json)
    return float(cfg["max_seconds"]), int(cfg["max_tokens"])


class Bar:
    """A tqdm bar on a terminal stream."""

    def __init__(self, stream, max_seconds: float, max_tokens: int) -> None:
        from tqdm import tqdm

        self.by_tokens = max_tokens > 0
        self.bar = tqdm(
            # follow the window's width; a pseudo-terminal reporting 0 rows or columns (`script`
            # in CI, a fresh pty) makes tqdm draw an empty bar, so take 100 columns there
            **({"dynamic_ncols": True} if _sized(stream) else {"ncols": 100}),
            total=max_tokens if self.by_tokens else max_seconds,
            unit="tok" if self.by_tokens else "s",
            unit_scale=self.by_tokens,
            file=stream,
            leave=True,
            bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}]{postfix}",
        )

    def show(self, s: Snapshot) -> None:
        done = s.tokens if self.by_tokens else round(s.elapsed_s, 1)
        self.bar.n = min(done, self.bar.total)
        self.bar.set_description_str(s.state, refresh=False)
        self.bar.set_postfix_str(
            f"loss {s.loss}  v{s.version}  {s.tokens / 1e6:.2f}M tok  up {s.up_bytes / 1e6:.1f}MB "
            f"down {s.down_bytes / 1e6:.1f}MB  learners {s.alive}/{s.members}",
            refresh=False,
        )
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _sized(stream) -> bool:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return size.columns > 0 and size.lines > 0


class Lines:
    """The plain line, one per call, for streams that are not a terminal."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def show(self, s: Snapshot) -> None:
        print(plain_line(s), file=self.stream, flush=True)

    def close(self) -> None:
        pass
