"""`ddiloco wan replica-index`: a Compose replica's datacenter index from its container name,
asked of the DNS server by a PTR query. Docker's embedded DNS server needs an engine; a real
UDP server on loopback answers here instead, the way Docker's does (`<name>.<network>.`,
with a compression pointer back into the question as real servers write)."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from ddiloco.wan.replica import ReplicaError, _encode, replica_number, reverse_name


@pytest.fixture
def dns():
    """A DNS server on 127.0.0.1 that answers every PTR query with ``names[address]``."""
    names: dict[str, str] = {}
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                query, peer = sock.recvfrom(512)
            except OSError:
                continue
            qid = struct.unpack(">H", query[:2])[0]
            question = query[12:]
            labels, pos = [], 0
            while question[pos]:
                labels.append(question[pos + 1:pos + 1 + question[pos]].decode())
                pos += 1 + question[pos]
            address = ".".join(reversed(labels[:4]))
            name = names.get(address)
            if name is None:  # NXDOMAIN
                sock.sendto(struct.pack(">HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question, peer)
                continue
            rdata = _encode(name)
            answer = b"\xc0\x0c" + struct.pack(">HHIH", 12, 1, 600, len(rdata)) + rdata  # name: pointer to offset 12
            sock.sendto(struct.pack(">HHHHHH", qid, 0x8180, 1, 1, 0, 0) + question + answer, peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield sock.getsockname()[1], names
    stop.set()
    thread.join(timeout=5)
    sock.close()


def test_the_replica_number_is_the_end_of_the_container_name():
    assert replica_number("ddiloco-learner-wan-3.ddiloco_datacenters") == 3
    assert replica_number("ddiloco-learner-12") == 12
    assert replica_number("ddiloco_learner_2.net") == 2  # Compose v1 names
    with pytest.raises(ReplicaError, match="does not end in a replica number"):
        replica_number("4f2a9c1d0e7b")  # a bare container id


def test_the_name_comes_from_a_ptr_query(dns):
    port, names = dns
    names["10.77.0.5"] = "ddiloco-learner-wan-mixed-3.ddiloco_datacenters"
    assert reverse_name("10.77.0.5", "127.0.0.1", port) == "ddiloco-learner-wan-mixed-3.ddiloco_datacenters"
    with pytest.raises(ReplicaError, match="gave no name for 10.77.0.9"):
        reverse_name("10.77.0.9", "127.0.0.1", port, timeout=0.5, tries=1)


def test_ddiloco_wan_replica_index_prints_the_datacenter_index(dns, capsys):
    from ddiloco.cli import main
    from ddiloco.wan.replica import own_address

    port, names = dns
    names[own_address()] = "ddiloco-learner-2.ddiloco_datacenters"
    assert main(["wan", "replica-index", "--dns", f"127.0.0.1:{port}"]) == 0
    assert capsys.readouterr().out.strip() == "1", "replica 2 is datacenter dc1"
    names[own_address()] = "some-host"
    assert main(["wan", "replica-index", "--dns", f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ddiloco wan replica-index: ") and "does not end in a replica number" in err
