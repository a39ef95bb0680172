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

This module's top level imports only the standard library and executor/driver_handover.py (the command's
side, which imports only the standard library): the command imports it before it knows whether it will
need the rest.
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
import time
from pathlib import Path
from typing import Any

from executor.driver_handover import (
    ANSWER_S,
    HELD,
    IMPORT_TIME_ENV,
    LIMITS,
    MAX_REQUEST,
    NAMESPACES,
    REQUEST_S,
    _peer,
    _rights,
    process_traits,
)

# Where callers (executor.__main__, tests) have always found them.
from executor.driver_handover import hand_over as hand_over
from executor.driver_handover import request_of as request_of

# What `rollout run` imports on its way to its first row, beyond the CLI itself (listed by running one
# from a server without them).
PRELOAD = (
    "executor.cli",
    "executor.api",
    "executor.driver",
    "executor.export",
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
# Ray's private modules among them, each imported where the installed Ray has it (executor/ray_private.py).
PRELOAD_RAY_PRIVATE = (
    "ray._common.usage.usage_lib",
    "ray._private.arrow_serialization",
    "ray._private.runtime_env.uv_runtime_env_hook",
)

# ---------------------------------------------------------------------------------------------------------
# The server's side


class Request:
    """A command's run, as the server read it; ``fds``: its stdin, stdout and stderr."""

    def __init__(self, data: dict[str, Any], fds: list[int]) -> None:
        self.args: list[str] = data["args"]
        self.cwd: str = data["cwd"]
        self.env: dict[str, str] = data["env"]
        self.path: list[str] = data["path"]  # the command's sys.path
        self.umask: int = data["umask"]
        self.ignored: list[int] = data["ignored"]  # signals the command ignores (nohup)
        self.fds = fds


def _checked(data: Any) -> dict[str, Any]:
    """``data`` if it is a request of the right shape; ValueError (one line) if not."""

    def strings(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    if not isinstance(data, dict):
        raise ValueError("not an object")
    env = data.get("env")
    if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        raise ValueError("env: not a map of strings")
    if not (strings(data.get("args")) and strings(data.get("path"))):
        raise ValueError("args, path: not lists of strings")
    if not isinstance(data.get("cwd"), str):
        raise ValueError("cwd: not a string")
    umask = data.get("umask")
    if not isinstance(umask, int) or not 0 <= umask <= 0o777:
        raise ValueError("umask: not a mode")
    ignored = data.get("ignored")
    if not (isinstance(ignored, list) and all(v in {int(s) for s in HELD} for v in ignored)):
        raise ValueError("ignored: not a list of signals")
    return data


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def installed_fingerprint() -> str:
    """Our source files (executor.warm.code_fingerprint) and the installed distributions (names and
    mtimes in site-packages): an upgraded Ray or pyarrow must not meet the server's imported one."""
    import hashlib
    import sysconfig

    from executor.warm import code_fingerprint

    digest = hashlib.sha256(code_fingerprint().encode())
    for key in ("purelib", "platlib"):
        site = sysconfig.get_paths()[key]
        with contextlib.suppress(OSError), os.scandir(site) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.name.endswith((".dist-info", ".pth")):
                    digest.update(f"{entry.name}:{entry.stat().st_mtime_ns};".encode())
    return digest.hexdigest()


SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5; Python 3.11 does not name it


class _PeerProcess:
    """The process at the other end of a connection, held by a pidfd from the connection itself (or,
    on an older kernel, opened at once), so that its pid cannot name another process meanwhile."""

    def __init__(self, conn: socket.socket) -> None:
        self.pid, self.uid = _peer(conn)
        try:
            self.pidfd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError:
            try:
                self.pidfd = os.pidfd_open(self.pid) if self.pid > 0 else -1
            except OSError:
                self.pidfd = -1

    def namespaces(self) -> dict[str, str]:
        """Its namespaces, or {} when they cannot be read or it has gone (its pid may be another's)."""
        if self.pidfd < 0:
            return {}
        try:
            theirs = {ns: os.readlink(f"/proc/{self.pid}/ns/{ns}") for ns in NAMESPACES}
        except OSError:
            return {}
        alive = not select.select([self.pidfd], [], [], 0)[0]  # read after the links: still the same one
        return theirs if alive else {}

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class _Server:
    """The accept loop. ``serve`` returns in a forked driver only, with its request; in the server it
    returns None once stopped and every driver it forked has ended."""

    def __init__(self, listener: socket.socket, path: Path, fingerprint: str, env: dict[str, str]) -> None:
        self.listener = listener
        self.path, self.inode = path, path.stat().st_ino
        self.traits = process_traits()
        self.namespaces = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in NAMESPACES}
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
                    try:
                        self._accept()
                    except _Driver as driver:
                        return driver.request
                elif item is not self.wake_r:
                    self._command_gone(item)

    def close(self) -> None:
        """Stop listening: the socket goes at once (a command then makes its run itself), unless a
        newer server's took its place."""
        self.listener.close()
        with contextlib.suppress(OSError):
            if self.path.stat().st_ino == self.inode:
                self.path.unlink()

    def _accept(self) -> None:
        """One command: refused, or served by a forked driver. Nothing a command sends ends the server;
        in the forked driver, raises _Driver with the request."""
        try:
            conn, _ = self.listener.accept()
        except OSError:
            time.sleep(0.05)  # out of descriptors, say: a pause, not a busy loop on a readable listener
            return None
        with conn:
            try:
                request, refused = self._read(conn)
            except Exception as exc:  # whatever a command sent: its connection goes, the server stays
                _log(f"a request was not read: {str(exc)[:200]}")
                return None
            if request is None:
                _log(f"refused a run: {refused}")
                with contextlib.suppress(OSError):
                    conn.sendall(b'{"refused": true}\n')  # why stays here: nothing for a probe to learn
                return None
            try:
                in_driver = self._fork(conn, request)
            except Exception as exc:
                in_driver = False
                _log(f"refused a run: {str(exc)[:200]}")
        if in_driver:  # out of every block of the server's: nothing of its cleanup runs here
            raise _Driver(request)
        for fd in request.fds:
            os.close(fd)  # the driver has them; the server never writes to a command's files
        return None

    def _fork(self, conn: socket.socket, request: Request) -> bool:
        """Fork the driver; it waits for the command's go-ahead, which comes once the command knows its
        pid, so that a command that gave up meanwhile (and runs the run itself) has no twin."""
        go_r, go_w = os.pipe()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)  # none may reach the copy's server handlers
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(go_r)
            os.close(go_w)
            _log(f"refused a run: cannot fork: {exc}")
            return False
        if pid == 0:
            try:
                os.close(go_w)
                self._become_driver(conn, request, mask)
                go = os.read(go_r, 3)
                os.close(go_r)
            except BaseException:
                os._exit(70)  # never back into the server's loop
            if go != b"go\n":
                os._exit(0)  # the command gave up before the go-ahead: it makes the run itself
            return True
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(go_r)
        pidfd, held = -1, None
        try:
            pidfd = os.pidfd_open(pid)
            held = conn.dup()  # ``conn`` is closed once the request is handled
            conn.settimeout(REQUEST_S)
            message = json.dumps({"pid": pid}).encode() + b"\n"
            conn.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [pidfd]))])
            if _line(conn, time.monotonic() + ANSWER_S) != b"go\n":
                raise ValueError("no go-ahead")
            os.write(go_w, b"go\n")
        except Exception as exc:
            _kill_unstarted(pid)
            for fd in (pidfd, held.detach() if held is not None else -1):
                if fd >= 0:
                    os.close(fd)
            _log(f"the command's driver did not start: {str(exc)[:200]}")
            with contextlib.suppress(OSError):
                conn.sendall(b'{"refused": true}\n')  # the run is the command's to make
            return False
        finally:
            os.close(go_w)
        with contextlib.suppress(OSError):
            conn.sendall(b'{"started": true}\n')
        held.setblocking(False)
        self.drivers[pidfd] = (pid, held)
        _log(f"serving `rollout {' '.join(request.args)[:200]}` in pid {pid}")
        return False

    def _read(self, conn: socket.socket) -> tuple[Request | None, str]:
        deadline = time.monotonic() + REQUEST_S
        conn.settimeout(REQUEST_S)
        peer = _PeerProcess(conn)
        size = struct.calcsize("!I")
        fds: list[int] = []
        try:
            header, ancillary, _flags, _addr = conn.recvmsg(
                size, socket.CMSG_SPACE(3 * 4), socket.MSG_CMSG_CLOEXEC
            )
            fds = _rights(ancillary)
            if len(header) != size or len(fds) != 3:
                raise ValueError("not a request")
            (length,) = struct.unpack("!I", header)
            if length > MAX_REQUEST:
                raise ValueError(f"request of {length} bytes")
            body = bytearray()
            while len(body) < length:
                conn.settimeout(max(0.0, deadline - time.monotonic()) or 0.001)  # one bound for it all
                chunk = conn.recv(min(1 << 16, length - len(body)))
                if not chunk:
                    raise ValueError("request cut short")
                body += chunk
            data = _checked(json.loads(body))
            refused = self._refusal(peer, data)
            if refused is not None:
                for fd in fds:
                    os.close(fd)
                return None, refused
            return Request(data, fds), ""
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        finally:
            peer.close()

    def _refusal(self, peer: _PeerProcess, data: dict[str, Any]) -> str | None:
        """Why a fresh process would not run as a driver forked from here would, or None."""
        if peer.uid != os.geteuid():
            return f"the command runs as uid {peer.uid}, the server as {os.geteuid()}"
        if peer.namespaces() != self.namespaces:
            return f"the command (pid {peer.pid}) is not in the server's namespaces (a sandbox's, say)"
        if data.get("package") != self.package or data.get("prefix") != sys.prefix:
            where = f"{str(data.get('package'))[:200]}, {str(data.get('prefix'))[:200]}"
            return f"another checkout or Python: {where}"
        if data.get("version") != sys.version:
            return "another Python version"
        if data.get("traits") != self.traits:
            return f"other resource limits, nice value, CPUs or groups: {str(data.get('traits'))[:500]}"
        if not os.path.isdir(data["cwd"]):
            return "its working directory is gone"
        if (theirs_env := import_time_env(data["env"])) != self.env:
            differ = sorted(set(theirs_env.items()) ^ set(self.env.items()))
            names = sorted({k for k, _ in differ})[:10]
            return f"the environment differs where modules read it at import: {names}"
        if installed_fingerprint() != self.fingerprint:
            self.stopping = True  # stale for every later run too: the warm executor starts a fresh server
            return "source files or installed packages changed since the server's imports"
        return None

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.drivers.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            report, said = {"signal": os.WTERMSIG(status)}, f"was killed by signal {os.WTERMSIG(status)}"
        else:
            report, said = {"exit": os.waitstatus_to_exitcode(status)}, f"exited {os.WEXITSTATUS(status)}"
        _log(f"pid {pid} {said}")
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.settimeout(REQUEST_S)
                conn.sendall(json.dumps(report).encode() + b"\n")
            conn.close()

    def _command_gone(self, conn: socket.socket) -> None:
        """The command's connection is readable before its driver ended: it closed (the command was
        killed), as a command sends nothing after its go-ahead. Its driver is interrupted as by a
        Ctrl-C (its rows stay durable, the run resumable), continued if it was stopped, and reaped here
        as usual."""
        for pidfd, (pid, held) in self.drivers.items():
            if held is conn:
                self.drivers[pidfd] = (pid, None)
                conn.close()
                for sig in (signal.SIGINT, signal.SIGCONT):
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(pidfd, sig)
                _log(f"the command of pid {pid} went; interrupted it")
                return

    def _become_driver(self, conn: socket.socket, request: Request, mask: set[signal.Signals]) -> None:
        """In the forked driver: nothing of the server's stays open or handled; the command's ignored
        signals are ignored here too."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sig in HELD:  # as the command has them, whatever the server inherited
            if int(sig) in request.ignored:
                signal.signal(sig, signal.SIG_IGN)
            else:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for pidfd, (_pid, held) in self.drivers.items():
            os.close(pidfd)
            if held is not None:
                held.close()
        self.drivers.clear()
        for end in (self.listener, self.wake_r, self.wake_w, conn):
            end.close()


class _Driver(Exception):
    """Raised in the forked driver, out of the server's loop, with its request."""

    def __init__(self, request: Request) -> None:
        super().__init__("forked driver")
        self.request = request


def _kill_unstarted(pid: int) -> None:
    """End a forked driver that never had its go-ahead: it has not begun the run."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _line(conn: socket.socket, deadline: float, limit: int = 64) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = conn.recv(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data


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
    # As Python makes a process's own (the environment that decides them is the server's: compared).
    for fd, mode, like in ((0, "r", sys.__stdin__), (1, "w", sys.__stdout__), (2, "w", sys.__stderr__)):
        tty = os.isatty(fd)
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        encoding = like.encoding if like is not None else "utf-8"
        errors = like.errors if like is not None else "strict"
        text = io.TextIOWrapper(
            buffered,
            encoding,
            errors,
            newline="\n",
            line_buffering=mode == "w" and (tty or fd == 2),
            write_through=mode == "w" and bool(getattr(like, "write_through", False)),
        )
        streams.append(text)
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

    from executor import ray_private
    from executor.schema import refuse_pandas

    refuse_pandas()  # as every run does, before anything could import it
    for name in PRELOAD:
        importlib.import_module(name)
    for name in PRELOAD_RAY_PRIVATE:
        ray_private.resolve(name)
    # What the imports made is never freed: kept out of the collector, a forked driver's collections do
    # not walk (and so copy) the server's pages.
    gc.collect()
    gc.freeze()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m executor.driver_server SOCKET READY_FD LIMITS_JSON", file=sys.stderr)
        return 2
    path, ready_fd = Path(argv[0]), int(argv[1])
    import resource

    # The limits `rollout up` was given: its daemon's were raised by Ray's start since.
    for name, (soft, hard) in json.loads(argv[2]).items():
        if name in LIMITS:
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(getattr(resource, name), (soft, hard))
    from sandboxes import proctree

    parent = os.getppid()
    proctree.prctl(proctree.PR_SET_PDEATHSIG, signal.SIGTERM)  # the warm executor's end is this one's
    if os.getppid() != parent:
        return 0
    fingerprint = installed_fingerprint()  # before the imports: an edit made meanwhile makes it stale
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
