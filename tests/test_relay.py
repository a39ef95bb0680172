"""The gateway's forwarder (sandboxes/netns.py): every connection relayed both ways by its one thread,
with real sockets: a half close passed on as one, a slow reader holding back only its own connection,
an upstream that does not answer its connect given up on, and no thread started per connection."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes import netns

TIMEOUT_S = 30.0


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


class _Upstream:
    """A Unix socket standing in for the gateway: each connection it accepts is handed to the test."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(path)
        self.listener.listen(64)
        self.listener.settimeout(TIMEOUT_S)

    def take(self) -> socket.socket:
        conn, _ = self.listener.accept()
        conn.settimeout(TIMEOUT_S)
        return conn


@pytest.fixture
def relayed(tmp_path: Path) -> Iterator[tuple[_Upstream, int]]:
    """The forwarder's listener on a free port of this host's loopback, relaying to an upstream."""
    upstream = _Upstream(str(tmp_path / "gw.sock"))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    netns.serve(listener, str(tmp_path / "gw.sock"))
    yield upstream, listener.getsockname()[1]
    upstream.listener.close()


def _client(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while data := sock.recv(65536):
        chunks.append(data)
    return b"".join(chunks)


def test_a_request_and_its_answer_pass_both_ways_with_each_end_passed_on(relayed):
    upstream, port = relayed
    client = _client(port)
    request = os.urandom(3 * 1024 * 1024)  # past any socket buffer: written as the other side reads
    writer = threading.Thread(target=lambda: (client.sendall(request), client.shutdown(socket.SHUT_WR)))
    writer.start()
    conn = upstream.take()
    assert _read_all(conn) == request  # then the end of the client's writing, as its own end
    writer.join(TIMEOUT_S)
    answer = os.urandom(2 * 1024 * 1024)
    conn.sendall(answer)
    conn.close()
    assert _read_all(client) == answer
    client.close()


def test_one_thread_relays_every_connection_and_a_slow_reader_holds_back_only_its_own(relayed):
    upstream, port = relayed
    before = _threads()
    clients = [_client(port) for _ in range(8)]
    conns = [upstream.take() for _ in clients]
    stalled = conns[0]
    # An answer far past the buffers to a client that reads none of it: the relay stops reading it.
    stalled.setblocking(False)
    sent = 0
    try:
        while sent < 64 * 1024 * 1024:
            sent += stalled.send(bytes(65536))
    except BlockingIOError:
        pass
    assert sent < 64 * 1024 * 1024  # the relay's reading stopped, so the upstream's writes did
    for i, (client, conn) in enumerate(zip(clients[1:], conns[1:], strict=True)):
        client.sendall(b"ping %d" % i)
        assert conn.recv(64) == b"ping %d" % i
        conn.sendall(b"pong %d" % i)
        assert client.recv(64) == b"pong %d" % i
    assert _threads() == before  # the forwarder's one thread was there before the connections
    stalled.setblocking(True)
    stalled.shutdown(socket.SHUT_WR)
    assert len(_read_all(clients[0])) == sent  # held back, never dropped
    for sock in clients + conns:
        sock.close()


def test_a_client_that_resets_its_connection_ends_the_relay_and_frees_its_slot(relayed):
    upstream, port = relayed
    for _ in range(3):
        client = _client(port)
        conn = upstream.take()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        client.close()  # a reset
        assert _read_all(conn) == b""  # the upstream's side ends too
        conn.close()


def test_a_client_that_resets_while_its_answer_waits_ends_the_relay(relayed):
    upstream, port = relayed
    client = _client(port)
    conn = upstream.take()
    conn.setblocking(False)
    try:  # an answer the client never reads, until the relay holds some of it back
        for _ in range(1024):
            conn.send(bytes(65536))
    except BlockingIOError:
        pass
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    client.close()  # a reset, with the relay's write to it pending
    conn.setblocking(True)
    try:  # the upstream's side ends too: cut, as what it sent was never read
        assert _read_all(conn) == b""
    except ConnectionResetError:
        pass
    conn.close()
    again = _client(port)  # and the forwarder serves on
    again.sendall(b"ping")
    served = upstream.take()
    assert served.recv(4) == b"ping"
    again.close()
    served.close()


def test_an_upstream_that_never_takes_the_connect_is_given_up_on(monkeypatch):
    """A remote gateway's connect under way (the agent's relay, sandboxes/agent_layers.py) is bounded: past
    it the client's connection is cut, and the forwarder goes on serving."""
    monkeypatch.setattr(netns, "CONNECT_TIMEOUT_S", 0.2)
    pending: list[socket.socket] = []

    def never_connects() -> socket.socket:
        sock, _peer = socket.socketpair()  # connected, so made to look under way by never being writable
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        try:
            while True:
                sock.send(bytes(65536))
        except BlockingIOError:
            pass
        pending.append(_peer)
        return sock

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    netns.serve_to(listener, never_connects)
    client = _client(listener.getsockname()[1])
    with pytest.raises(ConnectionResetError):
        client.recv(1)
    client.close()


def test_a_chunk_read_when_its_reader_has_no_room_at_all_waits_and_is_not_lost():
    """The steady connection's short path (netns._Relay.on_ready): a chunk read while the other side's
    buffer is full to the last byte is kept for it, not dropped."""
    import select

    client, client_far = socket.socketpair()
    upstream, upstream_far = socket.socketpair()
    for sock in (client, upstream):
        sock.setblocking(False)
    try:
        while True:  # the client's side full: not one byte more goes
            client.send(bytes(65536))
    except BlockingIOError:
        pass
    relay = netns._Relay(client, upstream, 0.0)
    relay.connect_by, relay.steady = None, True
    upstream_far.sendall(b"chunk")
    assert relay.on_ready(upstream, client, select.EPOLLIN)  # its interests change: the client's writes
    assert relay.pending[upstream] == b"chunk"
    for sock in (client, client_far, upstream, upstream_far):
        sock.close()
