"""`stack.train.comm.WireBytes`: the TCP bytes the kernel counted leaving this process, the store's excepted."""

import socket
import struct
import threading

from stack.train.comm import WireBytes, WireCount, wire_count


def _connected_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return server, client, accepted


def _send(sender: socket.socket, receiver: socket.socket, size: int) -> None:
    """Send `size` bytes while a thread reads them (a loopback buffer smaller than `size` would block sendall)."""
    def read() -> None:
        received = 0
        while received < size:
            received += len(receiver.recv(1 << 20))
    reader = threading.Thread(target=read)
    reader.start()
    sender.sendall(b"x" * size)
    reader.join(timeout=60)
    assert not reader.is_alive(), "the bytes sent never arrived"


def test_it_counts_what_this_process_sends_on_its_connections():
    server, client, accepted = _connected_pair()
    with server, client, accepted:
        wire = WireBytes(store_port=None)
        before = wire.total()
        _send(client, accepted, 3 << 20)
        _send(accepted, client, 1 << 20)
        assert (wire.total() - before).payload == 4 << 20  # both ends live in this process: both sends are ours


def test_the_rendezvous_stores_connection_is_not_counted():
    server, client, accepted = _connected_pair()
    with server, client, accepted:
        wire = WireBytes(store_port=server.getsockname()[1])
        before = wire.total()
        _send(client, accepted, 2 << 20)
        assert wire.total() == before


def test_bytes_sent_again_are_counted_apart_from_the_payload():
    """A retransmitted segment (a tail loss probe when an ACK is late) crossed the wire twice but carries nothing
    new: `tcpi_bytes_sent` counts it, `tcpi_bytes_retrans` says how much of it was sent again."""
    info = bytearray(232)
    struct.pack_into("QQ", info, 200, 1_000_000, 20_480)
    assert wire_count(bytes(info)) == WireCount(payload=1_000_000 - 20_480, retransmitted=20_480)
    assert wire_count(bytes(info[:208])) is None  # a kernel older than 4.19 says neither

