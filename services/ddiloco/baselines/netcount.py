"""Bytes a process moved over its TCP connections, read from the kernel.

gloo keeps no traffic counters, so the data-parallel baseline measures its all-reduce
traffic at the socket: for every TCP socket the process holds, ``TCP_INFO`` reports
``tcpi_bytes_acked`` (bytes sent and acknowledged by the peer) and ``tcpi_bytes_received``.
Summing the difference of two snapshots gives what this process sent and received in
between, whatever the collective algorithm, and it works the same inside a network
namespace. Linux only; elsewhere ``snapshot`` returns None and callers fall back to the
closed form.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

# struct tcp_info (linux/tcp.h): 8 one-byte fields, 24 u32 fields, then u64 pacing_rate,
# u64 max_pacing_rate, u64 bytes_acked, u64 bytes_received (both since Linux 4.1/4.2).
_BYTES_ACKED_OFFSET = 120
_TCP_INFO_LEN = 136


@dataclass(frozen=True)
class TcpBytes:
    sent: int
    received: int

    def __sub__(self, other: "TcpBytes") -> "TcpBytes":
        return TcpBytes(self.sent - other.sent, self.received - other.received)


def _socket_fds() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.append(int(name))
        except OSError:  # closed while we looked
            continue
    return fds


def snapshot() -> TcpBytes | None:
    """Totals over the TCP sockets open now; None where the kernel cannot tell."""
    if not os.path.isdir("/proc/self/fd") or not hasattr(socket, "TCP_INFO"):
        return None
    sent = received = 0
    for fd in _socket_fds():
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        sock = socket.socket(fileno=dup)  # owns the duplicate only; the original stays open
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            if len(info) < _TCP_INFO_LEN:
                return None  # kernel too old to count bytes
            acked, recv = struct.unpack_from("=QQ", info, _BYTES_ACKED_OFFSET)
            sent += acked
            received += recv
        except OSError:
            continue
        finally:
            sock.close()
    return TcpBytes(sent, received)


def ring_allreduce_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``payload_bytes`` (and receives as many):
    (W-1)/W of the payload in the reduce-scatter phase and again in the all-gather phase."""
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) * payload_bytes // world_size
