"""Egress bandwidth shaping of one network device with ``tc`` (tbf or htb).

Only rate limits: netem, and so added latency, is not available on the machines this
project runs on, and ingress policing needs act_police, which they lack too. A link is
therefore shaped in both directions by shaping the egress of each of its two ends.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass

QDISCS = ("tbf", "htb")
_CAP_NET_ADMIN = 12


class TcError(RuntimeError):
    """tc is missing, not permitted, or refused the command; the message says which."""


@dataclass(frozen=True)
class Shaping:
    dev: str
    kind: str  # the root qdisc: "tbf", "htb", or whatever the kernel shows when unshaped
    rate_bits: int | None  # None when the root qdisc limits nothing

    @property
    def shaped(self) -> bool:
        return self.rate_bits is not None


def tc_path() -> str:
    path = shutil.which("tc") or next(
        (p for p in ("/usr/sbin/tc", "/sbin/tc") if os.access(p, os.X_OK)), None
    )
    if path is None:
        raise TcError("tc not found: install iproute2 (Debian: apt-get install iproute2)")
    return path


def has_net_admin() -> bool:
    # uid 0 is not enough: root in a container without cap_add NET_ADMIN lacks it
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_NET_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def require_net_admin() -> None:
    if not has_net_admin():
        who = "root without CAP_NET_ADMIN" if os.geteuid() == 0 else f"uid {os.geteuid()}"
        raise TcError(
            f"shaping with tc needs root with CAP_NET_ADMIN; this process runs as {who}"
            " (in Docker: run the container as root with cap_add: [NET_ADMIN])"
        )


def _tc(*args: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess[str]:
    # ``tc -n NS`` talks netlink inside a named network namespace (ip netns), no exec needed
    cmd = [tc_path(), *(("-n", netns) if netns else ()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip()
        if "Operation not permitted" in err:
            raise TcError(f"`{' '.join(cmd)}` was not permitted: shaping needs root with CAP_NET_ADMIN")
        if "Cannot find device" in err:
            raise TcError(f"no network device {args[args.index('dev') + 1]!r}" if "dev" in args else err)
        raise TcError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {err}")
    return proc


def burst_bytes(rate_bits: int) -> int:
    # tbf needs at least rate/HZ bytes of bucket or it cannot reach its rate; 10 ms of
    # traffic covers HZ down to 100, and 32 KiB keeps slow links from stalling on GSO bursts.
    return max(32 * 1024, rate_bits // 8 // 100)


def clear(dev: str, *, netns: str | None = None) -> None:
    """Remove any root qdisc from ``dev`` (in namespace ``netns``, if given): the kernel's
    default, unshaped, comes back."""
    proc = _tc("qdisc", "del", "dev", dev, "root", check=False, netns=netns)
    if proc.returncode != 0:
        err = proc.stderr.strip()
        # deleting a default qdisc is how the kernel says there was nothing to remove
        if "handle of zero" in err or "No such file" in err or "Invalid handle" in err:
            return
        _tc("qdisc", "show", "dev", dev, netns=netns)  # raises the clearer error for a missing device
        if "Operation not permitted" in err:
            require_net_admin()
        raise TcError(f"tc qdisc del dev {dev} root failed: {err}")


def shape(
    dev: str, rate_bits: int | None, *, qdisc: str = "tbf", latency_ms: int = 50, netns: str | None = None
) -> Shaping:
    """Limit ``dev``'s egress to ``rate_bits`` (None: remove any limit), then read it back.
    ``netns`` names the network namespace (``ip netns``) the device lives in."""
    if qdisc not in QDISCS:
        raise ValueError(f"qdisc must be one of {QDISCS}, got {qdisc!r}")
    tc_path()
    if rate_bits is None:
        clear(dev, netns=netns)
        return read(dev, netns=netns)
    if rate_bits <= 0:
        raise ValueError(f"rate must be positive, got {rate_bits}")
    burst = burst_bytes(rate_bits)
    try:
        if qdisc == "tbf":
            _tc("qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bits}bit",
                "burst", str(burst), "latency", f"{latency_ms}ms", netns=netns)
        else:
            root = next((q for q in qdiscs(dev, netns=netns) if q.get("root")), {})
            # htb refuses to be replaced by htb; an htb 1: already there only needs its class
            if not (root.get("kind") == "htb" and root.get("handle") == "1:"):
                _tc("qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1", netns=netns)
            _tc("class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                "rate", f"{rate_bits}bit", "ceil", f"{rate_bits}bit", "burst", str(burst), netns=netns)
    except TcError:
        if not has_net_admin():
            require_net_admin()
        raise
    got = read(dev, netns=netns)
    if got.rate_bits is None or abs(got.rate_bits - rate_bits) > rate_bits // 100:
        raise TcError(f"shaped {dev} to {rate_bits} bit/s but read back {got}")
    return got


_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(text: str) -> int:
    """A tc rate as printed ("10Mbit", "1600bit", "12.5Kbit") in bits/s."""
    m = re.fullmatch(r"([0-9.]+)([kmgt]?)(bit|bps)", text.strip().lower())
    if not m:
        raise ValueError(f"not a tc rate: {text!r}")
    value = float(m.group(1)) * _UNIT[m.group(2)]
    return int(round(value * (8 if m.group(3) == "bps" else 1)))


def qdiscs(dev: str, *, netns: str | None = None) -> list[dict]:
    """``tc -j qdisc show dev DEV``, parsed."""
    out = _tc("-j", "qdisc", "show", "dev", dev, netns=netns).stdout.strip()
    return json.loads(out) if out else []


def read(dev: str, *, netns: str | None = None) -> Shaping:
    """The egress limit now in force on ``dev``, read from the kernel."""
    root = next((q for q in qdiscs(dev, netns=netns) if q.get("root")), None)
    if root is None:
        return Shaping(dev, "none", None)
    kind = root.get("kind", "?")
    if kind == "tbf":
        # tc -j prints tbf's rate in bytes/s
        return Shaping(dev, kind, int(root["options"]["rate"]) * 8)
    if kind == "htb":
        # iproute2 6.1 prints htb classes as text even under -j
        default = str(root.get("options", {}).get("default", "0x1"))
        minor = int(default, 16)
        handle = root.get("handle", "1:").rstrip(":")
        text = _tc("class", "show", "dev", dev, netns=netns).stdout
        for line in text.splitlines():
            m = re.match(rf"class htb {re.escape(handle)}:([0-9a-f]+) .*?\brate (\S+)", line)
            if m and int(m.group(1), 16) == minor:
                return Shaping(dev, kind, parse_rate(m.group(2)))
        return Shaping(dev, kind, None)
    return Shaping(dev, kind, None)


def _resolve(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    if not infos:
        raise TcError(f"cannot resolve {host!r}")
    return str(infos[0][4][0])


def device_towards(host: str | None = None) -> str:
    """The device that traffic to ``host`` (default: the default route) leaves by."""
    ip = shutil.which("ip") or "/usr/sbin/ip"
    if not os.access(ip, os.X_OK):
        raise TcError("ip not found: install iproute2 (Debian: apt-get install iproute2)")
    if host:
        if ":" in host and not host.startswith("["):
            host = host.rsplit(":", 1)[0]  # accept HOST:PORT
        try:
            addr = _resolve(host)
        except OSError as exc:
            raise TcError(f"cannot resolve {host!r}: {exc}") from exc
        cmd = [ip, "-j", "route", "get", addr]
    else:
        cmd = [ip, "-j", "route", "show", "default"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    routes = json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else []
    if not routes or "dev" not in routes[0]:
        raise TcError(f"no route {'to ' + host if host else 'by default'}: {proc.stderr.strip()}")
    return str(routes[0]["dev"])
