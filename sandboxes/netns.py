"""Network isolation for local sandboxes: each command in a loopback-only network namespace of its own.

A fresh namespace has only ``lo``, so nothing a harness tries to reach leaves the machine and failed
lookups fail at once. It also cuts the harness off from the gateway, whose loopback is not the
namespace's; but a path-based Unix socket crosses the boundary. So the gateway also listens on a Unix
socket, and the forwarder here, started inside the namespace by the command's init (sandboxes/
supervisor.py, or isolation.py under bwrap), brings ``lo`` up and serves ``127.0.0.1:PORT`` (the
gateway's own port number, so the harness's base URL is unchanged) by relaying each connection to that
socket. Standard library only: it is imported by those stdlib scripts.

Model calls are the harness's. Where the forwarder is given its sandbox's own procfs (a sandbox with a PID
namespace of its own: the local one as root, a container, a remote agent's as root), it tells the
harness's connections from the rest: the process that makes the sandbox's first connection (the harness:
nothing of the agent's runs before the model has answered it) is pinned by pid and start time, its
connections go to the gateway's socket, and any other process's (a tool the agent ran, a script it wrote)
to the gateway's other socket (``other_socket``), where the gateway refuses a model call for a harness
that makes its own from one process (harnesses/gateway/server.py). Otherwise the sandbox's code could draw
upstream failures at will (a flood that trips a rate limit, a request that stalls or that an endpoint
answers with a 5xx) and turn its row into an infrastructure failure: masked, never graded.
"""

from __future__ import annotations

import _thread
import contextlib
import fcntl
import os
import select
import socket
import struct
import sys
import time

if __package__:
    from sandboxes import proctree
else:  # imported by the stdlib scripts run by path: -I leaves our directory off sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import proctree

TYPE_CHECKING = False  # collections.abc is not worth importing in every command's init
if TYPE_CHECKING:
    from collections.abc import Callable

UNSHARE = "unshare"

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_CHUNK = 64 * 1024
_MAX_CONNECTIONS = 256  # a harness opens a handful; a runaway one must not exhaust descriptors
# An upstream that has not taken a connection in this long is not there (a remote gateway's connect).
CONNECT_TIMEOUT_S = 10.0
# The kernel's socket diagnostics (linux/sock_diag.h, inet_diag.h): one socket looked up by its addresses.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NO_COOKIE = 0xFFFFFFFF
_DIAG_INODE = 4 + 48 + 16  # in inet_diag_msg: family, state, timer, retrans; the socket id; 4 counters
# The executor's own processes between a sandbox's command and its forwarder (proctree.name_process): a
# model client's launchers end below them. A name is a process's own to change, which only cuts its
# descendants' chains shorter.
_EXECUTORS = frozenset(
    {
        b"rollout-sup",
        b"rollout-init",
        b"rollout-nsinit",
        b"rollout-server",
        b"rollout-zygote",
        b"rollout-view",
    }
)
_MAX_LAUNCHERS = 64


class IsolationUnavailable(Exception):
    """This host cannot make a network namespace (no ``unshare``, or not privileged)."""


def check_available() -> None:
    """Raise IsolationUnavailable, with the reason, unless ``unshare --net`` works here."""
    # Here, not at the top: every isolated command's init imports this module, and neither is needed there.
    import shutil
    import subprocess

    if shutil.which(UNSHARE) is None:
        raise IsolationUnavailable("sandbox.network 'isolated' needs the unshare command (util-linux)")
    try:
        probe = subprocess.run([UNSHARE, "--net", "--", "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise IsolationUnavailable(f"sandbox.network 'isolated': unshare --net failed: {exc}") from None
    if probe.returncode != 0:
        why = probe.stderr.decode("utf-8", "replace").strip()[:200]
        raise IsolationUnavailable(f"sandbox.network 'isolated' needs root (unshare --net: {why})")


# ---------------------------------------------------------------------------------------------------------
# Inside the namespace


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        if not flags & _IFF_UP:  # bubblewrap brings it up itself, and leaves an unprivileged user no right to
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def _unix(socket_path: str) -> socket.socket:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(socket_path)  # a local socket's connect does not wait on the network
    except OSError:
        upstream.close()
        raise
    upstream.setblocking(False)
    return upstream


class Forwarder:
    """A forwarder's state: its relays in flight (at most ``_MAX_CONNECTIONS``: a harness opens a handful;
    a runaway one must not exhaust descriptors), and where it has a procfs of its sandbox, the model
    client."""

    def __init__(self, model_client: ModelClient | None) -> None:
        self.model_client = model_client
        self._lock = _thread.allocate_lock()
        self.relaying = 0

    def take_slot(self) -> bool:
        with self._lock:
            if self.relaying >= _MAX_CONNECTIONS:
                return False
            self.relaying += 1
            return True

    def release_slot(self) -> None:
        with self._lock:
            self.relaying -= 1

    def forget(self) -> bool:
        """Make ready for the next sandbox in this network namespace, the ended one's processes all gone
        (namespaces.ServerInit.ready_for_next): nobody pinned as its model client. False while a relay
        of the ended one is still in flight: its slot is not the next sandbox's to lose."""
        with self._lock:
            if self.relaying:
                return False
        if self.model_client is not None:
            self.model_client.pinned = None
            self.model_client.launchers = frozenset()
        return True


class _Relay:
    """One connection relayed both ways, by the forwarder's one thread: each direction reads only once
    what it read before is written, so a slow reader holds back its writer, never the forwarder. The end
    of one side's writing is passed on as the end of the other's (a half close); a cut (an error either
    way) as a cut, never as a clean end of an answer."""

    def __init__(self, client: socket.socket, upstream: socket.socket, deadline: float) -> None:
        self.client, self.upstream = client, upstream
        self.connect_by: float | None = deadline  # until the upstream's connect has completed
        self.pending = {client: b"", upstream: b""}  # read from the key, not yet written to its peer
        self.ended: set[socket.socket] = set()  # sides whose reading has ended
        self.closed = False
        self.steady = False  # each side watched for reading alone (``settled``), as ``_serve`` left it

    def settled(self) -> bool:
        """Connected, nothing waiting to be written, neither side ended: each is watched for reading."""
        pending = self.pending
        return not (self.connect_by is not None or self.closed or self.ended or any(pending.values()))

    def interest(self, sock: socket.socket) -> int:
        if self.closed:
            return 0
        if self.connect_by is not None:
            return select.EPOLLOUT if sock is self.upstream else 0
        peer = self.upstream if sock is self.client else self.client
        events = 0
        if sock not in self.ended and not self.pending[sock]:
            events |= select.EPOLLIN
        if self.pending[peer]:
            events |= select.EPOLLOUT
        return events

    def on_ready(self, sock: socket.socket, peer: socket.socket, events: int) -> bool:
        """Read and write what ``sock``'s events allow; whether its sockets' interests may have changed
        (an answer streamed through a steady connection changes none: each chunk read is written at once)."""
        try:
            if self.steady and events == select.EPOLLIN:  # the common case, kept short
                data = sock.recv(_CHUNK)
                if data:
                    try:
                        sent = peer.send(data)
                    except (BlockingIOError, InterruptedError):  # no room at all: all of it waits
                        sent = 0
                    if sent == len(data):
                        return False
                    self.pending[sock] = data[sent:]
                else:
                    self.ended.add(sock)
                    self._flush(sock, peer)
                return True
            if self.connect_by is not None:
                if error := sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    raise OSError(error, os.strerror(error))
                self.connect_by = None
                return True
            if events & (select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP):  # an error shows in the send
                self._flush(peer, sock)
            if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and not self.pending[sock]:
                data = sock.recv(_CHUNK)
                if data:
                    self.pending[sock] = data
                else:
                    self.ended.add(sock)
                self._flush(sock, peer)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.cut()
        return True

    def _flush(self, src: socket.socket, dst: socket.socket) -> None:
        if data := self.pending[src]:
            self.pending[src] = data[dst.send(data) :]
        if src in self.ended and not self.pending[src]:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            if len(self.ended) == 2 and not self.pending[dst]:
                self.closed = True

    def cut(self) -> None:
        """A cut on one side must look like a cut on the other, not like a clean end of the answer."""
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.closed = True


def other_socket(socket_path: str) -> str:
    """The gateway's socket for connections its model client did not make: ``<name>.other.sock`` beside
    ``<name>.sock`` (a name the node's reaper of dead workers' sockets matches too)."""
    root, ext = os.path.splitext(socket_path)
    return f"{root}.other{ext}"


class ModelClient:
    """The sandbox's model client, one process at a time, pinned by pid and start time in ``proc``, a
    procfs of the sandbox's own PID namespace: the maker of the sandbox's first connection, and while it
    lives, it alone. Once it has ended, one of its launchers (the processes above it, up to the sandbox's
    command) or a process one of them started may take its place, as a `command` agent running one
    process per model call does. A process started by the agent's tools never can: it descends from a
    client, and once that client is gone it hangs from the supervisor (or the server, the namespace's
    init) that took it in, which is no launcher. Called by the accepting thread alone, so one connection
    is decided before the next is looked at."""

    def __init__(self, proc: str, port: int) -> None:
        self.proc = proc
        self.port = port
        self.pinned: tuple[int, int] | None = None
        self.launchers: frozenset[tuple[int, int]] = frozenset()

    def made(self, client: socket.socket) -> bool:
        """Whether ``client`` (accepted from the listener on our port) was opened by the model client. A
        connection whose maker cannot be found (it went already) is no one's."""
        try:
            target = _socket_link(client, self.port)
        except (OSError, ValueError):
            return False
        if target is None:
            return False
        if self.pinned is not None:
            pid, start = self.pinned
            info = proctree.read_proc(pid, self.proc)
            if info is not None and info.alive and info.start_ticks == start:
                return self._holds(pid, target)
        maker = self._maker(target)
        if maker is None:
            return False
        if self.pinned is not None and (maker.pid, maker.start_ticks) not in self.launchers:
            parent = proctree.read_proc(maker.ppid, self.proc)
            if parent is None or (parent.pid, parent.start_ticks) not in self.launchers:
                return False
        self.pinned = (maker.pid, maker.start_ticks)
        self.launchers = self._launchers(maker)
        return True

    def _maker(self, target: str) -> proctree.ProcInfo | None:
        try:
            names = os.listdir(self.proc)  # bounded by the sandbox's process cap
        except OSError:
            return None
        for name in names:
            if name.isdigit() and self._holds(int(name), target):
                return proctree.read_proc(int(name), self.proc)
        return None

    def _launchers(self, client: proctree.ProcInfo) -> frozenset[tuple[int, int]]:
        """The processes above ``client`` up to the sandbox's command: below the namespace's init and the
        executor's own processes (a supervisor, which takes in the orphans of the command's tree)."""
        chain: set[tuple[int, int]] = set()
        pid = client.ppid
        for _ in range(_MAX_LAUNCHERS):
            info = proctree.read_proc(pid, self.proc) if pid > 1 else None
            if info is None or info.name in _EXECUTORS:
                break
            chain.add((info.pid, info.start_ticks))
            pid = info.ppid
        return frozenset(chain)

    def _holds(self, pid: int, target: str) -> bool:
        fds = f"{self.proc}/{pid}/fd"
        try:
            names = os.listdir(fds)
        except OSError:
            return False
        for name in names:
            with contextlib.suppress(OSError):
                if os.readlink(f"{fds}/{name}") == target:
                    return True
        return False


def _socket_link(client: socket.socket, port: int) -> str | None:
    """What /proc/PID/fd shows for the connecting end of ``client``: its socket's inode, looked up by the
    two ends' addresses with the kernel's socket diagnostics (a lookup, where /proc/net/tcp is a walk of
    the host's whole connection table: ~1.3 ms). None when it has gone."""
    peer_port = client.getpeername()[1]
    loopback = socket.inet_aton("127.0.0.1") + bytes(12)
    sockid = struct.pack("!HH", peer_port, port) + loopback + loopback
    sockid += struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
    request = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as diag:
        diag.settimeout(5)  # the kernel answers at once; a bound all the same
        diag.send(header + request)
        answer = diag.recv(8192)
    length, kind = struct.unpack_from("=IH", answer)
    if kind != _SOCK_DIAG_BY_FAMILY or length < 16 + _DIAG_INODE + 4:
        return None  # NLMSG_ERROR: no such socket (it has gone)
    return f"socket:[{struct.unpack_from('=I', answer, 16 + _DIAG_INODE)[0]}]"


def _made_by(model_client: ModelClient, client: socket.socket) -> bool:
    try:
        return model_client.made(client)
    except Exception:  # no fault of the check may end the forwarder: the call is refused
        return False


def _serve(
    listener: socket.socket,
    connect: Callable[[], socket.socket],
    forwarder: Forwarder,
    connect_other: Callable[[], socket.socket] | None = None,
) -> None:
    """Accept and relay every connection from this one thread, none started for a connection: a root
    command nested in its container (sandboxes/nest.py) finds the threads there at its start sealed, and
    a thread started after it (for the harness's model connection) would be one whose
    /proc/TID/oom_score_adj, its whole process's, it could raise."""
    model_client = forwarder.model_client
    listener.setblocking(False)
    poller = select.epoll()
    listening = listener.fileno()
    poller.register(listening, select.EPOLLIN)
    sides: dict[int, tuple[_Relay, socket.socket, socket.socket]] = {}  # by descriptor: relay, it, peer
    watched: dict[int, int] = {}  # the events each descriptor is registered for
    connecting: set[_Relay] = set()
    while True:
        timeout = -1.0
        if connecting:
            timeout = max(0.0, min(r.connect_by or 0.0 for r in connecting) - time.monotonic())
        touched: set[_Relay] = set()
        for fd, events in poller.poll(timeout):
            if fd == listening:
                if (new := _accept(listener, connect, forwarder, model_client, connect_other)) is not None:
                    sides[new.client.fileno()] = (new, new.client, new.upstream)
                    sides[new.upstream.fileno()] = (new, new.upstream, new.client)
                    connecting.add(new)
                    touched.add(new)
            elif (side := sides.get(fd)) is not None and not side[0].closed:
                if side[0].on_ready(side[1], side[2], events):
                    touched.add(side[0])
        if connecting:
            now = time.monotonic()
            for relay in list(connecting):
                if relay.connect_by is None:
                    connecting.discard(relay)
                elif now >= relay.connect_by:
                    relay.cut()
                    touched.add(relay)
        for relay in touched:
            for sock in (relay.client, relay.upstream):
                _watch(poller, watched, sock.fileno(), relay.interest(sock))
            relay.steady = relay.settled()
            if relay.closed:
                connecting.discard(relay)
                for sock in (relay.client, relay.upstream):
                    sides.pop(sock.fileno(), None)
                    sock.close()
                forwarder.release_slot()


def _accept(
    listener: socket.socket,
    connect: Callable[[], socket.socket],
    forwarder: Forwarder,
    model_client: ModelClient | None,
    connect_other: Callable[[], socket.socket] | None,
) -> _Relay | None:
    """The relay of the connection waiting on ``listener``; None when there is none to relay."""
    try:
        client, _addr = listener.accept()
    except (BlockingIOError, InterruptedError, ConnectionAbortedError):
        return None
    if not forwarder.take_slot():
        client.close()
        return None
    # Streamed answers come in small writes: Nagle's algorithm would hold each until the last is acked.
    with contextlib.suppress(OSError):
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    target = connect
    if model_client is not None and connect_other is not None and not _made_by(model_client, client):
        target = connect_other
    try:
        upstream = target()
    except OSError:
        client.close()
        forwarder.release_slot()
        return None
    client.setblocking(False)
    return _Relay(client, upstream, time.monotonic() + CONNECT_TIMEOUT_S)


def _watch(poller: select.epoll, watched: dict[int, int], fd: int, events: int) -> None:
    """Register, change or drop (``events`` 0) the events ``fd`` is watched for."""
    was = watched.get(fd, 0)
    if events == was:
        return
    if not was:
        poller.register(fd, events)
        watched[fd] = events
    elif not events:
        poller.unregister(fd)
        del watched[fd]
    else:
        poller.modify(fd, events)
        watched[fd] = events


def listen(port: int, *, bring_up_loopback: bool = True) -> socket.socket:
    """Bring ``lo`` up and listen on 127.0.0.1:``port``: connections queue until ``serve`` relays them, so
    a command started in between finds the port open. A container's engine brings its ``lo`` up itself
    (and grants no CAP_NET_ADMIN to do it again)."""
    if bring_up_loopback:
        loopback_up()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    return listener


def serve(listener: socket.socket, socket_path: str, proc: str | None = None) -> Forwarder:
    """Relay each connection to ``listener`` to ``socket_path``, from a daemon thread. With ``proc``, a
    procfs of the sandbox's own PID namespace, a connection the sandbox's model client did not make goes
    to ``other_socket(socket_path)`` instead."""
    if proc is None:
        return serve_to(listener, lambda: _unix(socket_path))
    other = other_socket(socket_path)
    client = ModelClient(proc, listener.getsockname()[1])
    return serve_to(listener, lambda: _unix(socket_path), client, lambda: _unix(other))


def serve_to(
    listener: socket.socket,
    connect: Callable[[], socket.socket],
    model_client: ModelClient | None = None,
    connect_other: Callable[[], socket.socket] | None = None,
) -> Forwarder:
    """Relay each connection to ``listener`` to what ``connect`` opens (a socket set non-blocking, its
    connect done or under way), from one daemon thread; one that ``model_client`` did not make, to what
    ``connect_other`` opens."""
    forwarder = Forwarder(model_client)
    args = (listener, connect, forwarder, connect_other)
    _thread.start_new_thread(_serve, args)
    return forwarder


def start_forwarder(
    port: int, socket_path: str, *, bring_up_loopback: bool = True, proc: str | None = None
) -> Forwarder:
    """Serve 127.0.0.1:``port`` in this network namespace by relaying to ``socket_path`` (``serve``)."""
    return serve(listen(port, bring_up_loopback=bring_up_loopback), socket_path, proc)
