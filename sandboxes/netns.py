"""Network isolation for local sandboxes: each command in a loopback-only network namespace of its own.

A fresh namespace (``unshare --net``) has only ``lo``, so nothing a harness tries to reach leaves the
machine and failed lookups fail at once. It also cuts the harness off from the gateway, whose loopback
is not the namespace's; but a path-based Unix socket crosses the boundary. So the gateway also listens on
a Unix socket, and this module, run as the command's parent inside the namespace, brings ``lo`` up,
serves ``127.0.0.1:PORT`` (the gateway's own port number, so the harness's base URL is unchanged) by
relaying each connection to that socket, and runs the command. Standard library only: it runs as
``python3 -I -S netns.py`` like the supervisor.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading

NETNS_PATH = os.path.abspath(__file__)
UNSHARE = "unshare"

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_CHUNK = 64 * 1024
_MAX_CONNECTIONS = 256  # a harness opens a handful; a runaway one must not exhaust threads


class IsolationUnavailable(Exception):
    """This host cannot make a network namespace (no ``unshare``, or not privileged)."""


def isolated_argv(argv: list[str], port: int, socket_path: str) -> list[str]:
    """``argv`` run in a new network namespace where 127.0.0.1:``port`` reaches ``socket_path``."""
    return [
        UNSHARE,
        "--net",
        "--",
        sys.executable,
        "-I",
        "-S",
        NETNS_PATH,
        str(port),
        socket_path,
        "--",
        *argv,
    ]


def check_available() -> None:
    """Raise IsolationUnavailable, with the reason, unless ``unshare --net`` works here."""
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


def _relay(client: socket.socket, socket_path: str, slots: threading.BoundedSemaphore) -> None:
    try:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(socket_path)
        except OSError:
            upstream.close()
            return
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        upstream.close()
    finally:
        client.close()
        slots.release()


def _serve(listener: socket.socket, socket_path: str) -> None:
    slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
    while True:
        client, _addr = listener.accept()
        if not slots.acquire(blocking=False):
            client.close()
            continue
        threading.Thread(target=_relay, args=(client, socket_path, slots), daemon=True).start()


def main(args: list[str]) -> int:
    port, socket_path, sep, *argv = args
    if sep != "--" or not argv:
        print("usage: netns.py PORT SOCKET -- COMMAND...", file=sys.stderr)
        return 2
    _bring_up_loopback()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(port)))
    listener.listen(64)
    threading.Thread(target=_serve, args=(listener, socket_path), daemon=True).start()
    try:
        child = subprocess.Popen(argv)
    except OSError as exc:
        print(f"cannot run {argv[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    if code < 0:  # died of a signal: so do we, so the supervisor sees what the command saw
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP take no handler
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
