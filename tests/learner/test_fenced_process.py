"""A learner process cut off from the coordinator but not from the outer optimizer, and
replaced meanwhile, is stopped by the outer optimizer's fence (ddiloco.outer.known_learners):
its heartbeats cannot tell it, so without the fence it would train the shard and upload
beside its successor for as long as the cut lasts.

Real processes on real sockets: a coordinator, an outer optimizer and two learner processes
under id 0. The first reaches the coordinator through a TCP relay in this test, which is then
cut (its listening socket and connections closed, so the process's reconnections are
refused), as a partition between its datacenter and the coordinator's would; its link to the
outer optimizer stays up. The coordinator's lease is 3 s and expires in real time.
"""

from __future__ import annotations

import json
import socket
import threading

from ddiloco.launcher.processes import Cluster
from support import TINY_RUN, wait_serving, wait_until


class Relay:
    """Forwards TCP connections from ``address`` to ``target`` until ``cut``."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.is_cut = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                if self.is_cut:
                    client.close()
                    upstream.close()
                    return
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        with self.lock:
            self.is_cut = True
            self.listener.close()
            for s in self.sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


def _events(cluster: Cluster, kind: str) -> list[dict]:
    path = cluster.out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def _accepted(cluster: Cluster, incarnation: int) -> list[int]:
    """Sequence numbers of learner 0's deltas the outer optimizer accepted from ``incarnation``."""
    return [e["seq"] for e in _events(cluster, "delta_accepted") if e["learner"] == 0 and e["incarnation"] == incarnation]


def test_a_learner_cut_off_from_the_coordinator_and_replaced_is_stopped_by_the_outer_optimizer(tmp_path):
    cluster = Cluster(tmp_path)
    cluster.start_coordinator([*TINY_RUN, "--learners", "2", "--max-seconds", "600", "--lease-timeout", "3"])
    try:
        cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "outer registration")
        wait_serving(cluster.outer_address)
        relay = Relay(cluster.coordinator_address)
        old = cluster.start_learner(0, ["--device", "cpu", "--coordinator", relay.address], name="learner-0-old")
        wait_until(lambda: len(_accepted(cluster, 1)) >= 2, 180, "the first process's uploads")

        relay.cut()

        def lease_expired():
            m = cluster.membership()
            return m is not None and not {x.learner_id: x.alive for x in m.members}[0]

        wait_until(lease_expired, 60, "the first process's lease to expire")
        assert old.returncode() is None  # it trains and uploads on: only the coordinator is out of reach
        new = cluster.start_learner(0, ["--device", "cpu"], name="learner-0-new")

        code = old.popen.wait(timeout=180)
        log = old.log_path.read_text()
        assert code == 1, log[-3000:]
        assert "superseded: upload of fragment" in log and "incarnation 1 was replaced by incarnation 2" in log, log[-3000:]
        superseded = _events(cluster, "learner_superseded")
        assert [e["by"] for e in superseded] == ["uploader"], superseded

        wait_until(lambda: len(_accepted(cluster, 2)) >= 2, 180, "the second process's uploads")
        assert new.returncode() is None, new.log_path.read_text()[-3000:]
        assert "another process uploads as learner 0" not in new.log_path.read_text()
        # one unbroken sequence: the old process's, then the new one's from where it resumed,
        # and nothing of the old one after the new one's first
        accepted = [(e["seq"], e["incarnation"]) for e in _events(cluster, "delta_accepted") if e["learner"] == 0]
        seqs = [s for s, _ in accepted]
        assert seqs == list(range(1, len(seqs) + 1)), accepted
        first_new = next(i for i, (_, inc) in enumerate(accepted) if inc == 2)
        assert all(inc == 2 for _, inc in accepted[first_new:]), accepted
        refusals = [e for e in _events(cluster, "delta_refused") if e["code"] == "ABORTED"]
        assert [(e["learner"], e["incarnation"]) for e in refusals] == [(0, 1)], refusals  # the old process's, once
    finally:
        cluster.stop_all(grace=5)
