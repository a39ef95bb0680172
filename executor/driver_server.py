"""A driver process the warm executor keeps imported, so that `rollout run` skips its ~0.6 s of imports.

`rollout up` starts it beside the warm cluster (``python -m executor.driver_server SOCKET READY_FD``). It
imports what a run's driver imports (the CLI, Ray, pyarrow, pydantic, rich) and listens on a Unix socket
in the warm directory. The ``rollout`` command (``executor.__main__``) hands a ``run`` to it: its
arguments, working directory and environment, and its own stdin, stdout and stderr (SCM_RIGHTS). The
server forks; the copy takes the command's directory, environment, arguments and files and runs the CLI
exactly as the command's own process would have, attached to the warm executor or not. The command
forwards its signals (Ctrl-C) to the copy and exits with its exit code.

A request the server cannot serve as a fresh process would is refused, and the command runs in its own
process as without the server: another user, another checkout or Python, a changed environment where a
module reads it at import (``IMPORT_TIME_ENV``), or source files edited since the server's imports. The
last makes the server stop; the warm executor starts a fresh one.

This module's top level imports only the standard library: the command imports it before it knows
whether it will need the rest.
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
)
# What `rollout run` imports on its way to its first row, beyond the CLI itself (listed by running one
# from a server without them).
PRELOAD = (
    "executor.cli",
    "executor.driver",
    "executor.cluster",
    "executor.config",
    "executor.storage",
    "executor.runs",
    "executor.warm",
    "executor.preflight",
    "executor.progress",
    "executor.report",
    "executor.store",
    "executor.worker",
    "harnesses.codex",
    "harnesses.evidence",
    "harnesses.install",
    "ray.util",
    "ray._common.usage.usage_lib",
    "ray._private.arrow_serialization",
    "ray._private.runtime_env.uv_runtime_env_hook",
    "pyarrow.dataset",
    "pyarrow.json",
    "pyarrow.parquet",
    "pydantic.type_adapter",
    "rich._emoji_codes",
    "rich.markup",
    "typer._adapters",
    "typer._click.decorators",
    "argparse",
)
CONNECT_S = 2.0  # the server answers a connection at once; a hung one is not waited on
ANSWER_S = 10.0  # from the request to the forked driver's pid (or a refusal)
REQUEST_S = 5.0  # the server's bound on reading one request
REPORT_S = 10.0  # how long the command waits for the exit code once the driver has ended
MAX_REQUEST = 4 << 20  # bytes: arguments and environment
DISABLE_ENV = "ROLLOUT_DRIVER_SERVER"  # "0": never hand a run over
# A terminal's signals; Ctrl-Z (SIGTSTP) stops both, `fg` (SIGCONT) continues both.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGWINCH, signal.SIGCONT)
LIMITS = ("RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_CORE", "RLIMIT_FSIZE", "RLIMIT_AS", "RLIMIT_DATA")
LIMITS += ("RLIMIT_STACK", "RLIMIT_CPU", "RLIMIT_MEMLOCK", "RLIMIT_RSS")


def socket_path() -> Path:
    from executor.warm_files import SOCKET, warm_dir

    return warm_dir() / SOCKET


# ---------------------------------------------------------------------------------------------------------
# The command's side


def hand_over(args: list[str]) -> int | None:
    """Run ``rollout ARGS`` in a driver forked from the server: its exit code, or None when there is no
    server or it refused (the caller then runs the command itself, as without a server)."""
    path = socket_path()
    if os.environ.get(DISABLE_ENV) == "0" or not path.exists():
        return None
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:
        return None  # a closed standard file: nothing to pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(CONNECT_S)
        sock.connect(str(path))
        body = json.dumps(
            {
                "args": args,
                "cwd": os.getcwd(),
                "env": dict(os.environ),
                "package": str(Path(__file__).parent),
                "prefix": sys.prefix,
                "version": sys.version,
                "path": sys.path,
                "umask": _umask(),
                "traits": process_traits(),
            }
        ).encode()
        header = struct.pack("!I", len(body))
        sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        sock.sendall(body)
        sock.settimeout(ANSWER_S)
        answer = _read_line(sock)
    except (OSError, ValueError):
        sock.close()
        return None
    pid = answer.get("pid")
    if not isinstance(pid, int):
        sock.close()
        return None  # refused: answer["refused"] says why, for the server's log
    return _follow(sock, pid)


def process_traits() -> dict[str, Any]:
    """What a process inherits that the driver must share with the command, or the run goes otherwise:
    its resource limits and its nice value."""
    import resource

    limits = {name: list(resource.getrlimit(getattr(resource, name))) for name in LIMITS}
    return {"limits": limits, "nice": os.getpriority(os.PRIO_PROCESS, 0)}


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _follow(sock: socket.socket, pid: int) -> int:
    """Forward this command's signals to the driver ``pid`` until the server reports its exit code."""
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _kill(pid, signum))
    signal.signal(signal.SIGTSTP, lambda _signum, _frame: _suspend(pid))
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except OSError:
        pidfd = None  # it has ended (and been reaped) already: the server's report is on its way
    sock.settimeout(None)
    waiting: list[Any] = [sock] if pidfd is None else [sock, pidfd]
    bound_s: float | None = None  # the driver's own bounds end the run
    try:
        while waiting:
            ready, _, _ = select.select(waiting, [], [], bound_s)
            if not ready:
                break
            if sock in ready:
                try:
                    code = _read_line(sock).get("exit")
                    return code if isinstance(code, int) else 1
                except (OSError, ValueError):
                    waiting.remove(sock)  # the server went: the driver's end is waited for alone
            elif pidfd in ready:
                # Ended: the report follows at once, unless the server went too.
                waiting, bound_s = [w for w in waiting if w is sock], REPORT_S
    finally:
        sock.close()
        if pidfd is not None:
            os.close(pidfd)
    print(f"error: the warm executor's driver server did not report how pid {pid} ended", file=sys.stderr)
    return 1


def _suspend(pid: int) -> None:
    """Ctrl-Z: the driver stops with the command, as it would in the command's own process; the
    command's SIGCONT (`fg`) is forwarded."""
    _kill(pid, signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _read_line(sock: socket.socket, limit: int = 4096) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(limit - len(data))
        if not chunk:
            raise ValueError("connection closed")
        data += chunk
        if len(data) >= limit:
            raise ValueError("answer too long")
    answer = json.loads(data)
    if not isinstance(answer, dict):
        raise ValueError("not an object")
    return answer


# ---------------------------------------------------------------------------------------------------------
# The server's side


class Request:
    """A command's run, as the server read it; ``fds``: its stdin, stdout and stderr."""

    def __init__(
        self, args: list[str], cwd: str, env: dict[str, str], fds: list[int], path: list[str], umask: int
    ) -> None:
        self.args, self.cwd, self.env, self.fds = args, cwd, env, fds
        self.path, self.umask = path, umask  # the command's sys.path and umask


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


class _Server:
    """The accept loop. ``serve`` returns in a forked driver only, with its request; in the server it
    returns None once stopped and every driver it forked has ended."""

    def __init__(self, listener: socket.socket, path: Path, fingerprint: str, env: dict[str, str]) -> None:
        self.listener = listener
        self.path, self.inode = path, path.stat().st_ino
        self.traits = process_traits()
        self.fingerprint = fingerprint
        self.env = env
        self.package = str(Path(__file__).parent)
        self.drivers: dict[int, tuple[int, socket.socket | None]] = {}  # pidfd -> (pid, the command)
        self.stopping = False
        self.wake_r, self.wake_w = socket.socketpair()
        for end in (self.wake_r, self.wake_w):
            end.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._stop)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    def _stop(self, _signum: int, _frame: Any) -> None:
        self.stopping = True

    def serve(self) -> Request | None:
        while True:
            if self.stopping and self.listener.fileno() >= 0:
                self.close()  # no new runs; the running ones are still reported
            if self.stopping and not self.drivers:
                return None
            watched: list[Any] = [self.wake_r, *self.drivers]
            watched += [conn for _pid, conn in self.drivers.values() if conn is not None]
            if self.listener.fileno() >= 0:
                watched.append(self.listener)
            ready, _, _ = select.select(watched, [], [])
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    self.wake_r.recv(4096)
            for item in ready:
                if isinstance(item, int):
                    self._reap(item)
                elif item is self.listener and not self.stopping:
                    request = self._accept()
                    if request is not None:
                        return request
                elif item is not self.wake_r:
                    self._command_gone(item)

    def close(self) -> None:
        """Stop listening: the socket goes at once (a command then makes its run itself), unless a
        newer server's took its place."""
        self.listener.close()
        with contextlib.suppress(OSError):
            if self.path.stat().st_ino == self.inode:
                self.path.unlink()

    def _accept(self) -> Request | None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return None
        conn.settimeout(REQUEST_S)
        try:
            request, refused = self._read(conn)
        except (OSError, ValueError) as exc:
            _log(f"a request was not read: {str(exc)[:200]}")
            conn.close()
            return None
        if request is None:
            _log(f"refused a run: {refused}")
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"refused": refused}).encode() + b"\n")
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:
            self._become_driver(conn)
            return request
        for fd in request.fds:
            os.close(fd)
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            _kill(pid, signal.SIGINT)  # the command went before it learnt the pid: as if interrupted
        conn.setblocking(False)
        self.drivers[os.pidfd_open(pid)] = (pid, conn)
        _log(f"serving `rollout {' '.join(request.args)[:200]}` in pid {pid}")
        return None

    def _read(self, conn: socket.socket) -> tuple[Request | None, str]:
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        size = struct.calcsize("!I")
        header, ancillary, _flags, _addr = conn.recvmsg(size, socket.CMSG_SPACE(3 * 4))
        fds: list[int] = []
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        try:
            if len(header) != size or len(fds) != 3:
                raise ValueError("not a request")
            (length,) = struct.unpack("!I", header)
            if length > MAX_REQUEST:
                raise ValueError(f"request of {length} bytes")
            body = bytearray()
            while len(body) < length:
                chunk = conn.recv(min(1 << 16, length - len(body)))
                if not chunk:
                    raise ValueError("request cut short")
                body += chunk
            data = json.loads(body)
            refused = self._refusal(uid, data)
            if refused is not None:
                raise _Refused(refused)
            args, env = data["args"], data["env"]
            if not os.path.isdir(str(data["cwd"])):
                raise _Refused("its working directory is gone")
            if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
                raise ValueError("args: not a list of strings")
            if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
                raise ValueError("env: not a map of strings")
            path, umask = data.get("path"), data.get("umask")
            if not (isinstance(path, list) and all(isinstance(p, str) for p in path)):
                raise ValueError("path: not a list of strings")
            if not isinstance(umask, int) or not 0 <= umask <= 0o777:
                raise ValueError("umask: not a mode")
            return Request(args, str(data["cwd"]), env, fds, path, umask), ""
        except _Refused as exc:
            for fd in fds:
                os.close(fd)
            return None, str(exc)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _refusal(self, uid: int, data: dict[str, Any]) -> str | None:
        """Why a fresh process would not run as a driver forked from here would, or None."""
        if uid != os.geteuid():
            return f"the command runs as uid {uid}, the server as {os.geteuid()}"
        if data.get("package") != self.package or data.get("prefix") != sys.prefix:
            where = f"{str(data.get('package'))[:200]}, {str(data.get('prefix'))[:200]}"
            return f"another checkout or Python: {where}"
        if data.get("version") != sys.version:
            return "another Python version"
        if data.get("traits") != self.traits:
            return f"other resource limits or nice value: {str(data.get('traits'))[:500]}"
        env = data.get("env")
        if isinstance(env, dict) and (theirs := import_time_env(env)) != self.env:
            differ = sorted(set(theirs.items()) ^ set(self.env.items()))
            names = sorted({k for k, _ in differ})[:10]
            return f"the environment differs where modules read it at import: {names}"
        from executor.warm import code_fingerprint

        if code_fingerprint() != self.fingerprint:
            self.stopping = True  # stale for every later run too: the warm executor starts a fresh server
            return "source files changed since the server's imports"
        return None

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.drivers.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
        _log(f"pid {pid} exited {code}")
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.settimeout(REQUEST_S)
                conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
            conn.close()

    def _command_gone(self, conn: socket.socket) -> None:
        """The command's connection is readable before its driver ended: it closed (the command was
        killed), as a command sends nothing after its request. Its driver is interrupted as by a
        Ctrl-C (its rows stay durable, the run resumable), and reaped here as usual."""
        for pidfd, (pid, held) in self.drivers.items():
            if held is conn:
                self.drivers[pidfd] = (pid, None)
                conn.close()
                _kill(pid, signal.SIGINT)
                _log(f"the command of pid {pid} went; interrupted it")
                return

    def _become_driver(self, conn: socket.socket) -> None:
        """In the forked driver: nothing of the server's stays open or handled."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for pidfd, (_pid, held) in self.drivers.items():
            os.close(pidfd)
            if held is not None:
                held.close()
        self.drivers.clear()
        for end in (self.listener, self.wake_r, self.wake_w, conn):
            end.close()


class _Refused(Exception):
    pass


def _log(message: str) -> None:
    print(f"driver server: {message}", file=sys.stderr, flush=True)


def _run_as_command(request: Request) -> None:
    """In the forked driver: take the command's files, directory, environment and arguments, then run
    the CLI; its SystemExit ends this process as it would have ended the command's."""
    import io
    import logging

    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request.cwd)
    os.umask(request.umask)
    os.environ.clear()
    os.environ.update(request.env)
    sys.path[:] = request.path
    streams = []
    for fd, mode in ((0, "r"), (1, "w"), (2, "w")):
        tty = os.isatty(fd)
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        errors = "backslashreplace" if fd == 2 else "strict"
        streams.append(
            io.TextIOWrapper(
                buffered, encoding=sys.stdout.encoding, errors=errors, line_buffering=tty or fd == 2
            )
        )
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams
    sys.argv = ["rollout", *request.args]
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    from rich.console import Console

    from executor import cli

    cli.console = Console()  # it read the server's terminal and environment when it was made
    cli.app(args=request.args, prog_name="rollout")


def _preload() -> None:
    import gc
    import importlib

    from executor.schema import refuse_pandas

    refuse_pandas()  # as every run does, before anything could import it
    for name in PRELOAD:
        importlib.import_module(name)
    # What the imports made is never freed: kept out of the collector, a forked driver's collections do
    # not walk (and so copy) the server's pages.
    gc.collect()
    gc.freeze()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m executor.driver_server SOCKET READY_FD", file=sys.stderr)
        return 2
    path, ready_fd = Path(argv[0]), int(argv[1])
    from executor.warm import code_fingerprint
    from sandboxes import proctree

    parent = os.getppid()
    proctree.prctl(proctree.PR_SET_PDEATHSIG, signal.SIGTERM)  # the warm executor's end is this one's
    if os.getppid() != parent:
        return 0
    fingerprint = code_fingerprint()  # before the imports: an edit made meanwhile makes it stale
    env = import_time_env(dict(os.environ))  # as the imports found it (importing Ray sets some)
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    # Bound aside and renamed once listening: a command finds no socket, or one that answers.
    staging = path.with_name(f"{path.name}.{os.getpid()}")
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(staging))
    except OSError as exc:  # a path past the 107 bytes a Unix socket's may have, say
        _log(f"cannot listen on {str(staging)[:300]}: {exc.strerror or exc}")
        return 1
    finally:
        os.umask(old_umask)
    listener.listen(16)
    os.replace(staging, path)  # over a killed server's: the warm executor holds the directory
    server = _Server(listener, path, fingerprint, env)
    os.write(ready_fd, b"ready\n")
    os.close(ready_fd)
    request = server.serve()
    if request is not None:
        _run_as_command(request)  # the forked driver; the CLI ends it
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
