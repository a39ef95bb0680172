"""Handing a `rollout run` over to the warm executor's pre-imported driver (executor/driver_server.py):
what both ends share (bounds, the signals forwarded, the traits a peer must share with the server) and the
command's side (``hand_over``: ask, pass the files, forward signals, report the exit code).

The ``rollout`` command (``executor.__main__``) hands a ``run`` over: its arguments, working directory and
environment, and its own stdin, stdout and stderr (SCM_RIGHTS). The server forks; the copy takes them and
runs the CLI exactly as the command's own process would have. The command forwards its signals (Ctrl-C) to
the copy and exits with its exit code.

This module imports only the standard library: the command imports it before it knows whether it will need
the rest.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import Any

# Variables a module reads when it is imported (Python itself, Ray, gRPC, Arrow, the locale, typer's and
# rich's switches): the server's imports saw its own, so a request whose values differ is refused.
IMPORT_TIME_ENV = (
    "PYTHON",
    "RAY_",
    "GRPC_",
    "ARROW_",
    "OMP_",
    "LD_",
    "LANG",
    "LC_",
    "TZ",
    "PYDANTIC",
    "TYPER_",
    "_TYPER",
    "FORCE_COLOR",
    "NO_COLOR",
    "PY_COLORS",
    "TERMINAL_",
    "GITHUB_ACTIONS",
    "MALLOC_",
    "GLIBC_TUNABLES",
    "JE_",
    "PYARROW_",
)
CONNECT_S = 2.0  # the server answers a connection at once; a hung one is not waited on
ANSWER_S = 10.0  # from the request to the forked driver's pid (or a refusal)
REQUEST_S = 5.0  # the server's bound on reading one request, and on the command's go-ahead
REPORT_S = 10.0  # how long the command waits for the exit code once the driver has ended
MAX_REQUEST = 4 << 20  # bytes: arguments and environment
DISABLE_ENV = "ROLLOUT_DRIVER_SERVER"  # "0": never hand a run over
# A terminal's signals; Ctrl-Z (SIGTSTP) stops both, `fg` (SIGCONT) continues both.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGWINCH, signal.SIGCONT)
HELD = (*FORWARDED, signal.SIGTSTP)
LIMITS = ("RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_CORE", "RLIMIT_FSIZE", "RLIMIT_AS", "RLIMIT_DATA")
LIMITS += ("RLIMIT_STACK", "RLIMIT_CPU", "RLIMIT_MEMLOCK", "RLIMIT_RSS")
# The peer must share these with the server: a sandbox's command (another mount, pid or network
# namespace) never reaches a driver on the host, whatever user it runs as.
NAMESPACES = ("mnt", "pid", "net", "user", "ipc", "uts", "cgroup")


def socket_path() -> Path:
    from executor.warm_files import SOCKET, warm_dir

    return warm_dir() / SOCKET


# ---------------------------------------------------------------------------------------------------------
# The command's side


def hand_over(args: list[str]) -> int | None:
    """Run ``rollout ARGS`` in a driver forked from the server: its exit code, or None when there is no
    server or it did not take the run (the caller then runs the command itself, as without a server).
    Once the driver has the go-ahead, this command never runs the run itself."""
    if os.environ.get(DISABLE_ENV) == "0":
        return None
    # A Ctrl-C before the driver's pid is known is held, then forwarded, or raised here on a fallback.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        sock, pidfd, pid = _ask(args)
    except Exception:  # no server, a refusal, or one that did not answer in time: run it here
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return None
    return _follow(sock, pidfd, pid, held)


def _ask(args: list[str]) -> tuple[socket.socket, int, int]:
    path = socket_path()
    for fd in (0, 1, 2):
        os.fstat(fd)  # a closed standard file: nothing to pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(CONNECT_S)
        sock.connect(str(path))
        # The environment (keys among it) goes only to a server of this user.
        if _peer(sock)[1] != os.geteuid():
            raise PermissionError(f"{path} is another user's")
        body = json.dumps(request_of(args)).encode()
        header = struct.pack("!I", len(body))
        sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        sock.sendall(body)
        sock.settimeout(ANSWER_S)
        answer, fds = _receive(sock)
        pid = answer.get("pid")
        if not isinstance(pid, int) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ValueError("refused")  # why is in the server's log
    except BaseException:
        sock.close()
        raise
    pidfd = fds[0]
    try:
        sock.sendall(b"go\n")
        started, _ = _receive(sock)
    except (OSError, ValueError):
        # The server went after the go-ahead, or did not confirm in time: the driver may have started,
        # so this command follows it and never makes the run itself.
        return sock, pidfd, pid
    if started.get("started") is not True:  # it never started the driver: the run is this command's
        sock.close()
        os.close(pidfd)
        raise ValueError("refused")
    return sock, pidfd, pid


def request_of(args: list[str]) -> dict[str, Any]:
    """What this process hands the server for ``rollout ARGS``: all a forked driver takes from it, and
    all the server compares with its own."""
    return {
        "args": args,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "package": str(Path(__file__).parent),
        "prefix": sys.prefix,
        "version": sys.version,
        "path": sys.path,
        "umask": _umask(),
        "ignored": [int(sig) for sig in HELD if signal.getsignal(sig) is signal.SIG_IGN],
        "traits": process_traits(),
    }


def process_traits() -> dict[str, Any]:
    """What a process inherits that the driver must share with the command, or the run goes otherwise:
    its resource limits, nice value, CPUs and groups."""
    import resource

    return {
        "limits": {name: list(resource.getrlimit(getattr(resource, name))) for name in LIMITS},
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "cpus": sorted(os.sched_getaffinity(0)),
        "groups": [os.getegid(), *sorted(os.getgroups())],
    }


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def _follow(sock: socket.socket, pidfd: int, pid: int, held: set[signal.Signals]) -> int:
    """Forward this command's signals to the driver until the server reports how it ended; then end
    as it did (its exit code, or its signal)."""

    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signum)

    def suspend(_signum: int, _frame: Any) -> None:
        forward(signal.SIGSTOP, None)  # Ctrl-Z: the driver stops with the command, as in its process
        os.kill(os.getpid(), signal.SIGSTOP)

    for sig in HELD:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # `nohup`, a script's `&`: the driver ignores it too
            signal.signal(sig, suspend if sig == signal.SIGTSTP else forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    sock.settimeout(None)
    waiting: list[Any] = [sock, pidfd]
    bound_s: float | None = None  # the driver's own bounds end the run
    ended: dict[str, Any] = {}
    try:
        while waiting and not ended:
            ready, _, _ = select.select(waiting, [], [], bound_s)
            if not ready:
                break
            if sock in ready:
                try:
                    ended = _receive(sock)[0]
                except (OSError, ValueError):
                    waiting.remove(sock)  # the server went: the driver's end is waited for alone
            elif pidfd in ready:
                # Ended: the report follows at once, unless the server went too.
                waiting, bound_s = [w for w in waiting if w is sock], REPORT_S
    finally:
        sock.close()
        os.close(pidfd)
    if isinstance(code := ended.get("exit"), int):
        return code
    if isinstance(signum := ended.get("signal"), int):
        # Killed by a signal: so is this command (a shell's loop of runs stops at a Ctrl-C).
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's and SIGSTOP's cannot be set
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        return 128 + signum
    print(f"error: the warm executor's driver server did not report how pid {pid} ended", file=sys.stderr)
    return 1


def _receive(sock: socket.socket, limit: int = 4096) -> tuple[dict[str, Any], list[int]]:
    """One line of JSON, and the descriptors that came with it."""
    data, fds = b"", []
    try:
        while not data.endswith(b"\n"):
            chunk, ancillary, _flags, _addr = sock.recvmsg(
                limit - len(data), socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC
            )
            fds.extend(_rights(ancillary))
            if not chunk:
                raise ValueError("connection closed")
            data += chunk
            if len(data) >= limit:
                raise ValueError("answer too long")
        answer = json.loads(data)
        if not isinstance(answer, dict):
            raise ValueError("not an object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return answer, fds


def _rights(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors an SCM_RIGHTS message carried."""
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
    return fds
