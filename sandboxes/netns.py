"""Network isolation for local sandboxes: each command in a loopback-only network namespace of its own.

A fresh namespace has only ``lo``, so nothing a harness tries to reach leaves the machine and failed
lookups fail at once. It also cuts the harness off from the gateway, whose loopback is not the
namespace's; but a path-based Unix socket crosses the boundary. So the gateway also listens on a Unix
socket, and the forwarder here, started inside the namespace by the command's init (sandboxes/
supervisor.py, or isolation.py under bwrap), brings ``lo`` up and serves ``127.0.0.1:PORT`` (the
gateway's own port number, so the harness's base URL is unchanged) by relaying each connection to that
socket. Standard library only: it is imported by those stdlib scripts.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import threading

TYPE_CHECKING = False  # collections.abc is not worth importing in every command's init
if TYPE_CHECKING:
    from collections.abc import Callable

UNSHARE = "unshare"

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_CHUNK = 64 * 1024
_MAX_CONNECTIONS = 256  # a harness opens a handful; a runaway one must not exhaust threads


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


def _bring_up_loopback() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        if not flags & _IFF_UP:  # bubblewrap brings it up itself, and leaves an unprivileged user no right to
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy until the source ends; then end the destination's writing side, or reset it on an error."""
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
    except OSError:
        # A cut on one side must look like a cut on the other, not like a clean end of the answer.
        with contextlib.suppress(OSError):
            dst.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            dst.shutdown(socket.SHUT_RDWR)


def _unix(socket_path: str) -> socket.socket:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(socket_path)
    except OSError:
        upstream.close()
        raise
    return upstream


def _relay(
    client: socket.socket, connect: Callable[[], socket.socket], slots: threading.BoundedSemaphore
) -> None:
    try:
        try:
            upstream = connect()
        except OSError:
            return
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        upstream.close()
    finally:
        client.close()
        slots.release()


def _serve(listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
    slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
    while True:
        client, _addr = listener.accept()
        if not slots.acquire(blocking=False):
            client.close()
            continue
        # Streamed answers come in small writes: Nagle's algorithm would hold each until the last is acked.
        with contextlib.suppress(OSError):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_relay, args=(client, connect, slots), daemon=True).start()


def listen(port: int, *, bring_up_loopback: bool = True) -> socket.socket:
    """Bring ``lo`` up and listen on 127.0.0.1:``port``: connections queue until ``serve`` relays them, so
    a command started in between finds the port open. A container's engine brings its ``lo`` up itself
    (and grants no CAP_NET_ADMIN to do it again)."""
    if bring_up_loopback:
        _bring_up_loopback()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    return listener


def serve(listener: socket.socket, socket_path: str) -> None:
    """Relay each connection to ``listener`` to ``socket_path``, from a daemon thread."""
    serve_to(listener, lambda: _unix(socket_path))


def serve_to(listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
    """Relay each connection to ``listener`` to what ``connect`` opens, from a daemon thread."""
    threading.Thread(target=_serve, args=(listener, connect), daemon=True).start()


def start_forwarder(port: int, socket_path: str, *, bring_up_loopback: bool = True) -> None:
    """Serve 127.0.0.1:``port`` in this network namespace by relaying to ``socket_path``."""
    serve(listen(port, bring_up_loopback=bring_up_loopback), socket_path)
