"""A TCP relay on 127.0.0.1 that slows one direction to a fixed rate.

Put in front of the outer optimizer (the outer advertises the relay's address), it turns a
millisecond upload into a seconds-long one, so a test can SIGKILL a learner while its delta
is provably half-way through the wire. Real sockets, real bytes; it only paces them.
Each accepted connection records its client port and the bytes relayed upstream, so a test
can tell which process a connection belongs to (``ports_of_pid``).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Conn:
    client_port: int
    up_bytes: int = 0
    closed: bool = False
    aborted: bool = False
    held: threading.Event = field(default_factory=threading.Event)  # set: relay nothing upstream
    lock: threading.Lock = field(default_factory=threading.Lock)


class Throttle:
    def __init__(self, upstream_port: int, up_rate_bytes_s: float, chunk: int = 4096) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.rate = up_rate_bytes_s
        self.chunk = chunk
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[Conn] = []
        self.stop_event = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.stop_event.set()
        self.listener.close()

    def abort(self, conn: Conn) -> None:
        """Cut ``conn`` now, as a dead host's link would: bytes not yet relayed never
        arrive, and both ends see a reset."""
        conn.aborted = True

    def hold(self, conn: Conn) -> None:
        """Stop relaying ``conn`` upstream, as a stalled host's link would; ``release`` resumes."""
        conn.held.set()

    def release(self, conn: Conn) -> None:
        conn.held.clear()

    def _accept(self) -> None:
        while not self.stop_event.is_set():
            try:
                client, addr = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            conn = Conn(addr[1])
            self.conns.append(conn)
            threading.Thread(target=self._pump, args=(client, server, conn, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, conn: Conn, up: bool) -> None:
        try:
            while True:
                data = src.recv(self.chunk if up else 1 << 16)
                if not data:
                    break
                if up:
                    # pace: each chunk leaves no earlier than its share of the rate allows
                    for i in range(0, len(data), 1024):
                        piece = data[i : i + 1024]
                        while conn.held.is_set() and not conn.aborted:
                            time.sleep(0.01)
                        if conn.aborted:
                            raise ConnectionAbortedError
                        dst.sendall(piece)
                        with conn.lock:
                            conn.up_bytes += len(piece)
                        time.sleep(len(piece) / self.rate)
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            conn.closed = True
            for s in (src, dst):
                try:
                    if conn.aborted:  # RST instead of FIN: the peer must not take it as a clean end
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    else:
                        s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # the other direction's pump closed it first
                s.close()


def ports_of_pid(pid: int) -> set[int]:
    """Local TCP ports of the sockets process ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[9] in inodes:
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports
