"""Build and tear down the namespace topology of one run.

::

    root namespace (launcher)            hub namespace (coordinator, outer)          dc<i> namespace (learner i)
    <prefix>m 198.18.S.1/30 ---veth--- mgmt 198.18.S.2/30   (unshaped, control only)
                                       dc<i> 198.18.S.(4i+5)/30 ---veth, tc both ends--- wan0 198.18.S.(4i+6)/30

Addresses come from 198.18.0.0/15, which RFC 2544 reserves for network benchmarks, so they
never clash with a real network. Each run gets its own /24 (its *slot* S), so the routes a
run adds to the root namespace never collide with a parallel run's. The hub's address on the
management link is the services' address: the launcher reaches it directly, and datacenters
reach it through their default route to the hub (the hub accepts packets for any of its own
addresses on any interface, so a learner's traffic to it never crosses another datacenter's
link). The hub forwards between datacenters, so data-parallel ranks can talk to each other,
each packet crossing the sender's link and the receiver's, both shaped.

Interfaces inside a namespace have short fixed names (``mgmt``, ``dc0``..., ``wan0``); only
the root end of the management link needs a name unique on the machine.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from ddiloco.wan import tc
from ddiloco.wan.profiles import Profile

NETWORK = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmark range
MAX_SLOTS = NETWORK.num_addresses // 256  # one /24 per run
MAX_DATACENTERS = 63  # /30 links 1..63 of the run's /24; link 0 is the management link
HUB_DC_DEV = "dc{}"
DC_DEV = "wan0"
HUB_MGMT_DEV = "mgmt"
# names this module creates: dd + 3 hex (slot) + 4 hex (random) + a suffix
PREFIX_RE = re.compile(r"^dd[0-9a-f]{3}[0-9a-f]{4}$")
NAMESPACE_RE = re.compile(r"^(dd[0-9a-f]{3}[0-9a-f]{4})-(hub|dc[0-9]+)$")
_CAP_SYS_ADMIN = 21


class NetnsError(RuntimeError):
    """A namespace, link or route could not be made or removed; the message says why."""


@dataclass(frozen=True)
class DatacenterLink:
    index: int
    namespace: str
    hub_dev: str  # the hub's end, inside the hub namespace
    dc_dev: str  # the datacenter's end, inside its namespace
    hub_address: str  # the hub's end: the datacenter's gateway
    address: str  # the datacenter's end: where its learner binds
    rate_bits: int | None  # egress limit of each end; None: unshaped


@dataclass(frozen=True)
class Plan:
    """Every name and address of one run's topology, decided before anything is created (so
    that the marker file of the run can list what to remove if the launcher dies)."""

    prefix: str
    slot: int
    profile: str
    qdisc: str
    hub_namespace: str
    hub_address: str
    root_dev: str
    root_address: str
    datacenters: tuple[DatacenterLink, ...]

    @property
    def namespaces(self) -> list[str]:
        return [self.hub_namespace, *(d.namespace for d in self.datacenters)]


def _subnet_host(slot: int, offset: int) -> str:
    return str(NETWORK.network_address + slot * 256 + offset)


def make_plan(prefix: str, slot: int, profile: Profile, datacenters: int, qdisc: str = "tbf") -> Plan:
    if not PREFIX_RE.match(prefix):
        raise ValueError(f"prefix must look like dd<7 hex digits>, got {prefix!r}")
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"slot must be in [0, {MAX_SLOTS}), got {slot}")
    if not 1 <= datacenters <= MAX_DATACENTERS:
        raise ValueError(f"the netns topology holds 1 to {MAX_DATACENTERS} datacenters, got {datacenters}")
    if qdisc not in tc.QDISCS:
        raise ValueError(f"qdisc must be one of {tc.QDISCS}, got {qdisc!r}")
    links = tuple(
        DatacenterLink(
            index=i,
            namespace=f"{prefix}-dc{i}",
            hub_dev=HUB_DC_DEV.format(i),
            dc_dev=DC_DEV,
            hub_address=_subnet_host(slot, 4 * (i + 1) + 1),
            address=_subnet_host(slot, 4 * (i + 1) + 2),
            rate_bits=profile.rate_for(i),
        )
        for i in range(datacenters)
    )
    return Plan(
        prefix=prefix,
        slot=slot,
        profile=profile.name,
        qdisc=qdisc,
        hub_namespace=f"{prefix}-hub",
        hub_address=_subnet_host(slot, 2),
        root_dev=f"{prefix}m",
        root_address=_subnet_host(slot, 1),
        datacenters=links,
    )


def slot_of_address(address: str) -> int | None:
    ip = ipaddress.ip_address(address)
    if ip.version != 4 or ip not in NETWORK:
        return None
    return (int(ip) - int(NETWORK.network_address)) // 256


# --- privileges and the ip command -------------------------------------------------------


def _capability(bit: int) -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def require_root() -> None:
    """Creating namespaces needs CAP_SYS_ADMIN (``ip netns add`` mounts) and CAP_NET_ADMIN."""
    if not (tc.has_net_admin() and _capability(_CAP_SYS_ADMIN)):
        who = "root without CAP_NET_ADMIN/CAP_SYS_ADMIN" if os.geteuid() == 0 else f"uid {os.geteuid()}"
        raise NetnsError(
            f"--topology netns needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN, to create network namespaces and "
            f"shape links with tc); this process runs as {who}. Run it as root (sudo), or use --topology local."
        )
    ip_path()
    tc.tc_path()


def ip_path() -> str:
    path = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)
    if path is None:
        raise NetnsError("ip not found: install iproute2 (Debian: apt-get install iproute2)")
    return path


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [ip_path(), *(("-n", netns) if netns else ()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip()
        if "Operation not permitted" in err or "Permission denied" in err:
            require_root()  # raises the clear message when that is the cause
        raise NetnsError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {err}")
    return proc


def in_namespace(namespace: str) -> list[str]:
    """The command prefix that runs a program inside ``namespace`` (with its own /sys)."""
    return [ip_path(), "netns", "exec", namespace]


def _sysctl(namespace: str, *settings: str) -> None:
    proc = subprocess.run([*in_namespace(namespace), "sysctl", "-qw", *settings], capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetnsError(f"sysctl {' '.join(settings)} in {namespace} failed: {proc.stderr.strip()}")


def list_namespaces() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def link_exists(dev: str, netns: str | None = None) -> bool:
    return ip("link", "show", "dev", dev, netns=netns, check=False).returncode == 0


# --- build ------------------------------------------------------------------------------


@dataclass
class Built:
    plan: Plan
    # per datacenter: the shaping the kernel reports on (hub end, datacenter end)
    shaping: list[tuple[tc.Shaping, tc.Shaping]] = field(default_factory=list)


def _new_namespace(name: str, *, forward: bool) -> None:
    ip("netns", "add", name)
    ip("link", "set", "lo", "up", netns=name)
    # no IPv6: its router solicitations and DAD would add stray bytes to the counted links
    settings = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
    if forward:
        settings.append("net.ipv4.ip_forward=1")
    _sysctl(name, *settings)


def build(plan: Plan) -> Built:
    """Create the namespaces, links, addresses, routes and shaping of ``plan``. On error the
    caller tears down (everything made is named in the plan)."""
    require_root()
    hub = plan.hub_namespace
    _new_namespace(hub, forward=True)
    # management link: root <-> hub, unshaped, carries only the launcher's control calls
    ip("link", "add", plan.root_dev, "type", "veth", "peer", "name", HUB_MGMT_DEV, "netns", hub)
    ip("addr", "add", f"{plan.root_address}/30", "dev", plan.root_dev)
    ip("link", "set", plan.root_dev, "up")
    ip("addr", "add", f"{plan.hub_address}/30", "dev", HUB_MGMT_DEV, netns=hub)
    ip("link", "set", HUB_MGMT_DEV, "up", netns=hub)
    built = Built(plan)
    for link in plan.datacenters:
        _new_namespace(link.namespace, forward=False)
        ip("link", "add", link.hub_dev, "type", "veth", "peer", "name", link.dc_dev, "netns", link.namespace, netns=hub)
        ip("addr", "add", f"{link.hub_address}/30", "dev", link.hub_dev, netns=hub)
        ip("addr", "add", f"{link.address}/30", "dev", link.dc_dev, netns=link.namespace)
        ip("link", "set", link.hub_dev, "up", netns=hub)
        ip("link", "set", link.dc_dev, "up", netns=link.namespace)
        ip("route", "add", "default", "via", link.hub_address, netns=link.namespace)
        # a link is shaped in both directions by shaping the egress of each of its ends
        try:
            down = tc.shape(link.hub_dev, link.rate_bits, qdisc=plan.qdisc, netns=hub)
            up = tc.shape(link.dc_dev, link.rate_bits, qdisc=plan.qdisc, netns=link.namespace)
        except tc.TcError as exc:
            raise NetnsError(f"shaping datacenter {link.index}'s link failed: {exc}") from exc
        built.shaping.append((down, up))
    return built


# --- tear down --------------------------------------------------------------------------


def namespace_pids(namespace: str) -> list[int]:
    proc = ip("netns", "pids", namespace, check=False)
    return [int(x) for x in proc.stdout.split() if x.strip().isdigit()]


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_processes(namespaces: list[str], grace: float = 5.0) -> list[int]:
    """SIGTERM every process still inside ``namespaces``, SIGKILL those left after ``grace``.
    A namespace with processes in it outlives ``ip netns del``, and so would they."""
    present = set(list_namespaces())
    pids = sorted({p for ns in namespaces if ns in present for p in namespace_pids(ns)} - {os.getpid()})
    if not pids:
        return []
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)  # polling the processes' exit, bounded by grace
    _signal_all([p for p in pids if _alive(p)], signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"  # a zombie has exited; only its parent's wait is missing
    except (OSError, IndexError):
        return False


def teardown(namespaces: list[str], root_devs: list[str], grace: float = 5.0) -> list[str]:
    """Remove what a run made: its processes, namespaces (their veth ends go with them) and
    root-namespace links. Returns what was actually removed; missing parts are no error."""
    removed: list[str] = []
    kill_processes(namespaces, grace)
    present = set(list_namespaces())
    errors = []
    for ns in namespaces:
        if ns in present:
            proc = ip("netns", "del", ns, check=False)
            if proc.returncode == 0:
                removed.append(ns)
            else:
                errors.append(f"netns {ns}: {proc.stderr.strip()}")
    for dev in root_devs:
        # normally gone with the hub namespace (deleting one veth end deletes both)
        if link_exists(dev):
            proc = ip("link", "del", dev, check=False)
            if proc.returncode == 0:
                removed.append(dev)
            elif link_exists(dev):
                errors.append(f"link {dev}: {proc.stderr.strip()}")
    if errors:
        raise NetnsError("could not remove " + "; ".join(errors))
    return removed
