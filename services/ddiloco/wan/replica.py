"""Which replica of a Compose service this container is, from its name.

``deploy.replicas: N`` starts containers named ``<project>-<service>-1`` ... ``-N``, but
gives them no variable with that number (Swarm has ``{{.Task.Slot}}``, Kubernetes
``JOB_COMPLETION_INDEX``; Compose nothing). Docker's embedded DNS server does know the
name: a reverse (PTR) lookup of the container's own address answers
``<container name>.<network>.``. The C library would answer from ``/etc/hosts`` first
(the random hostname), so this asks the DNS server itself, with one UDP query.
"""

from __future__ import annotations

import re
import secrets
import socket
import struct

PTR, IN = 12, 1
_REPLICA = re.compile(r"[-_]([0-9]+)$")  # ddiloco-learner-wan-3 (Compose v2), ddiloco_learner_3 (v1)


class ReplicaError(Exception):
    """The container's replica number cannot be found (the message says why)."""


def own_address() -> str:
    """This container's address on its network (what ``hostname -i`` prints)."""
    return socket.gethostbyname(socket.gethostname())


def nameserver(resolv_conf: str = "/etc/resolv.conf") -> str:
    try:
        with open(resolv_conf, encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    return parts[1]
    except OSError as exc:
        raise ReplicaError(f"cannot read {resolv_conf}: {exc}") from None
    raise ReplicaError(f"no nameserver in {resolv_conf}")


def reverse_name(address: str, server: str, port: int = 53, timeout: float = 2.0, tries: int = 3) -> str:
    """The PTR name of ``address`` (IPv4) as ``server`` answers it, without the final dot."""
    qname = ".".join(reversed(address.split("."))) + ".in-addr.arpa"
    for _ in range(tries):
        qid = secrets.randbelow(1 << 16)
        query = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + _encode(qname) + struct.pack(">HH", PTR, IN)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.sendto(query, (server, port))
                reply, _ = sock.recvfrom(4096)
            except OSError:  # a timeout, or nothing listening: ask again
                continue
        name = _answer(reply, qid)
        if name is not None:
            return name
    raise ReplicaError(f"the DNS server {server} gave no name for {address}")


def replica_number(name: str) -> int:
    """``ddiloco-learner-wan-3.ddiloco_datacenters`` -> 3 (1-based, as Compose numbers them)."""
    m = _REPLICA.search(name.split(".", 1)[0])
    if not m:
        raise ReplicaError(f"{name!r} does not end in a replica number (<project>-<service>-<n>)")
    return int(m.group(1))


def container_index(server: str | None = None, port: int = 53) -> int:
    """This container's 0-based replica index: its datacenter index in ``compose.yaml``."""
    return replica_number(reverse_name(own_address(), server or nameserver(), port)) - 1


def _encode(name: str) -> bytes:
    return b"".join(bytes([len(label)]) + label.encode("ascii") for label in name.split(".")) + b"\0"


def _answer(reply: bytes, qid: int) -> str | None:
    """The first PTR record of a reply to query ``qid``; None for another reply or none."""
    if len(reply) < 12:
        return None
    rid, flags, qd, an, _, _ = struct.unpack(">HHHHHH", reply[:12])
    if rid != qid or not flags & 0x8000 or flags & 0x000F:  # not our answer, or an error code
        return None
    pos = 12
    for _ in range(qd):
        _, pos = _read_name(reply, pos)
        pos += 4
    for _ in range(an):
        _, pos = _read_name(reply, pos)
        rtype, _, _, length = struct.unpack(">HHIH", reply[pos:pos + 10])
        pos += 10
        if rtype == PTR:
            return _read_name(reply, pos)[0]
        pos += length
    return None


def _read_name(msg: bytes, pos: int) -> tuple[str, int]:
    """A (possibly compressed) domain name at ``pos``; returns it and the position after it."""
    labels, end, jumps = [], None, 0
    while True:
        length = msg[pos]
        if length & 0xC0 == 0xC0:  # a pointer to a name earlier in the message
            if end is None:
                end = pos + 2
            pos = ((length & 0x3F) << 8) | msg[pos + 1]
            jumps += 1
            if jumps > 32:
                raise ReplicaError("a DNS name points in a loop")
            continue
        if length == 0:
            return ".".join(labels), (end if end is not None else pos + 1)
        labels.append(msg[pos + 1:pos + 1 + length].decode("ascii", "replace"))
        pos += 1 + length
