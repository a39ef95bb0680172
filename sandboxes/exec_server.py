"""The worker's side of a local sandbox's supervisor server (``supervisor_server.py``) and of the
provider's fork server (``zygote.py``) that forks those servers.

One server process per sandbox forks a supervisor for each command (or, for a command alone in its
sandbox, supervises it itself: sandboxes/folded.py), so a command costs a fork instead of an
interpreter start-up and the supervisor's imports (tens of milliseconds, several times per rollout);
one fork server per provider forks each sandbox's server, so a sandbox costs a fork too. The protocols
are described beside the servers. The worker waits for a server's end on a pidfd read by its
event loop, not on a thread per child (asyncio's child watcher in Python 3.11 holds one per process).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandboxes import native_init, proctree
from sandboxes.base import SandboxError, SandboxLostError
from sandboxes.environment import SANDBOX_MARKER_VAR, marker_entry

log = logging.getLogger(__name__)

SERVER_PATH = str(Path(__file__).resolve().with_name("supervisor_server.py"))
ZYGOTE_PATH = str(Path(__file__).resolve().with_name("zygote.py"))
# How long a fork may take to be acknowledged: the server may still be starting on a loaded host.
SPAWN_TIMEOUT_S = 120.0
ZYGOTE_EXIT_S = 2.0  # how long a fork server's death may lag its closed pipes, and its end at close
# How long a server killed at its stop may take to be gone. One that is its PID namespace's init leaves
# only once the kernel has reaped everything in the namespace, which a process stuck in the kernel
# (uninterruptible) can hold up indefinitely: the sandbox's stop then says what is left instead.
KILLED_EXIT_S = 30.0


class ZygoteGone(OSError):
    """The fork server has died: the provider starts another, or the server the old way."""


async def _ready(
    fd: int, timeout: float, *, write: bool = False, ready: asyncio.Future[None] | None = None
) -> bool:
    """Whether ``fd`` becomes readable (a pidfd: its process has ended), or writable, within ``timeout``;
    or first ``ready``, the future waited on, is resolved by someone else (the descriptor's owner, closing
    it). An event loop keeps one callback per descriptor and direction: one waiter at a time per ``fd``."""
    loop = asyncio.get_running_loop()
    if ready is None:
        ready = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        remove(fd)  # a no-op where the owner took the callback off before closing it


@functools.cache
def _build_native_init() -> str | None:
    """The native init's build (native_init.py), made once a process: a machine without a compiler is
    asked once."""
    return native_init.build()


class Zygote:
    """A running fork server. Started with the environment a server gets (the marker variable alone, a
    placeholder token), from /, every descriptor of ours closed but its end of the control socket."""

    def __init__(self, log_path: Path) -> None:
        _build_native_init()  # before the fork server's start: it looks for the build once, at import
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as zygote_log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", ZYGOTE_PATH, str(os.getpid()), str(theirs.fileno())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=zygote_log,
                    pass_fds=(theirs.fileno(),),
                    cwd="/",
                    env={SANDBOX_MARKER_VAR: uuid.uuid4().hex},
                    start_new_session=True,
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock: socket.socket | None = ours
        # One request at a time waits for room on the socket (``_room``): an event loop keeps one writer
        # callback per descriptor, and a second waiter's took the first one's place, which then waited out
        # SPAWN_TIMEOUT_S (a burst of starts beyond the socket's buffer, ~150 requests). By event loop:
        # the provider, and so we, may outlive one (a lock once waited on is bound to its loop).
        self._sending: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._room_wait: asyncio.Future[None] | None = None
        self.pid = self._proc.pid

    @property
    def alive(self) -> bool:
        return self._sock is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    async def fork(self, request: dict[str, Any], fds: tuple[int, int]) -> None:
        """Send one request with the new server's two pipe ends; the server answers on its own pipe."""
        message = [json.dumps(request).encode()]
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        loop = asyncio.get_running_loop()
        if self._sending is None or self._sending[0] is not loop:
            self._sending = (loop, asyncio.Lock())
        async with self._sending[1]:
            for _ in range(1000):  # bounded: each round waits for room, which a live fork server makes
                sock = self._sock  # closed meanwhile (another request found it gone): None
                if sock is None:
                    raise ZygoteGone("the fork server is closed")
                try:
                    sock.sendmsg(message, rights)
                    return
                except BlockingIOError:
                    if not await self._room(sock):
                        waited = f"{SPAWN_TIMEOUT_S:.0f} s"
                        raise ZygoteGone(f"the fork server took no request for {waited}") from None
                except OSError as exc:  # EPIPE, ECONNRESET: it has died
                    raise ZygoteGone(f"the fork server has exited: {exc}") from exc
        raise ZygoteGone("the fork server takes no requests")

    async def _room(self, sock: socket.socket) -> bool:
        """Whether the fork server makes room for a request within SPAWN_TIMEOUT_S (or is closed)."""
        self._room_wait = asyncio.get_running_loop().create_future()
        try:
            return await _ready(sock.fileno(), SPAWN_TIMEOUT_S, write=True, ready=self._room_wait)
        finally:
            self._room_wait = None

    async def ended(self, timeout: float) -> bool:
        """Whether the fork server ends within ``timeout``; reaped if it has."""
        if self._proc.poll() is not None:
            return True
        try:
            pidfd = os.pidfd_open(self.pid)  # our child, not reaped yet: the pid is still its own
        except ProcessLookupError:
            return self._proc.poll() is not None
        try:
            await _ready(pidfd, timeout)
        finally:
            os.close(pidfd)
        return self._proc.poll() is not None

    async def close(self) -> None:
        """No more forks: it exits once the servers it forked have (they outlive it if it must go);
        waited for a short while, and reaped if it is gone (else by ``subprocess`` later)."""
        if self._sock is not None:
            if self._room_wait is not None and not self._room_wait.done():  # a request waits for room
                asyncio.get_running_loop().remove_writer(self._sock.fileno())
                self._room_wait.set_result(None)  # it finds us closed
            self._sock.close()
            self._sock = None
        await self.ended(ZYGOTE_EXIT_S)


class ServedExec:
    """One forked supervisor, or a command its server supervises itself (``tell`` then takes the signals
    meant for its supervisor, sandboxes/folded.py; ``pid`` is its init's): the part of
    ``asyncio.subprocess.Process`` the sandbox uses."""

    def __init__(self, pid: int, marker: bytes, tell: Callable[[int], None] | None = None) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._marker = marker
        self._tell = tell
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def ended(self) -> bool:
        return self._ended.done()

    async def wait(self) -> int | None:
        await asyncio.shield(self._ended)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self._ended.done():
            return
        if self._tell is not None:
            self._tell(sig)
            return
        # The server reaps the supervisor before we hear of it; the marker check keeps a signal from
        # reaching a process that took over the pid in between.
        if proctree.has_env_entry(self.pid, self._marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def _end(self, status: int | None) -> None:
        if not self._ended.done():
            self.returncode = None if status is None else os.waitstatus_to_exitcode(status)
            self._ended.set_result(None)


class ExecServer:
    """A running supervisor server. Build it with ``ExecServer.start``."""

    def __init__(
        self,
        pid: int,
        pidfd: int,
        pipes: tuple[asyncio.StreamReader, asyncio.WriteTransport, asyncio.BaseProtocol],
        marker_token: str,
        pid_namespace: bool,
        child: subprocess.Popen[bytes] | None,
        reusable: bool = False,
        later_mounts: bool = False,
    ) -> None:
        self.pid = pid
        self.pid_namespace = pid_namespace
        # It serves another sandbox once one has ended (``hand_on``): the init of its PID namespace itself.
        self.reusable = reusable
        # Its commands see what is mounted on the host after its start (a session directory's tmpfs).
        self.later_mounts = later_mounts
        self.loop = asyncio.get_running_loop()
        self.marker_token = marker_token
        self.cgroups: dict[str, str] = {}  # its sandbox's cgroup.procs by controller (pidlimit.py)
        self._marker = marker_entry(marker_token)
        self._stdout, transport, protocol = pipes
        self._stdin = asyncio.StreamWriter(transport, protocol, None, asyncio.get_running_loop())
        self._child = child  # ours to reap when we started it; a fork server's reaps its own
        self._pidfd = pidfd
        self._exit_code: int | None = None  # what the server said last: 0 once its namespace is empty
        self._exited = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_reader(pidfd, self._on_exit)
        self._ids = itertools.count(1)
        self._starting: dict[int, asyncio.Future[ServedExec]] = {}
        self._live: dict[int, ServedExec] = {}
        self._abandoned: set[int] = set()  # requests whose caller was cancelled before the fork was told
        self._handed_on: asyncio.Future[None] | None = None  # the answer to a "next" under way
        self._closed = False
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(
        cls,
        *,
        env: dict[str, str],
        marker_token: str,
        log_path: Path,
        pid_namespace: bool = False,
        network_forward: tuple[int, str] | None = None,
        zygote: Zygote | None = None,
        views: bool = False,
        network_handed_on: bool = False,
    ) -> ExecServer:
        """Forked by ``zygote``, or else a new interpreter. ``env`` must carry the marker: /proc/PID/environ
        of the server and of every supervisor it forks shows it, which is how the sandbox finds its
        processes (a forked server writes it over its fork server's placeholder). ``pid_namespace``:
        every command runs in one PID namespace, made by the server at its start (see namespaces.py); with
        ``network_forward`` (port, gateway socket), in one loopback-only network namespace too. ``views``:
        every command has a filesystem view (a forked server's namespace then needs no mount namespace).
        ``network_handed_on``: no command of the sandbox can change its network namespace (none runs as
        root), so that the fork server may give it an ended sandbox's and hand it on after (zygote.py).
        Raises ZygoteGone when ``zygote`` has died, OSError when the server cannot be started."""
        loop = asyncio.get_running_loop()
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        child: subprocess.Popen[bytes] | None = None
        try:
            if zygote is not None:
                network = list(network_forward) if network_forward else None
                request = {
                    "marker": marker_token,
                    "pid_namespace": pid_namespace,
                    "network": network,
                    "views": views,
                    "network_handed_on": network_handed_on,
                }
                await zygote.fork(request, (stdin_r, stdout_w))
            else:
                child = _spawn_server(env, log_path, pid_namespace, network_forward, stdin_r, stdout_w)
        except BaseException:
            os.close(stdin_w)
            os.close(stdout_r)
            raise
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        stdout = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), open(stdout_r, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, open(stdin_w, "wb", 0)
        )
        try:
            pid, reusable, later_mounts = await cls._ready(stdout, zygote)
            if child is not None and pid != child.pid:
                raise OSError(f"the supervisor server says it is pid {pid}, not {child.pid}")
            pidfd = os.pidfd_open(pid)
            # A forked server is not our child: its pid is its own only while it carries our marker.
            if child is None and not proctree.has_env_entry(pid, marker_entry(marker_token)):
                os.close(pidfd)
                raise OSError(f"the supervisor server (pid {pid}) ended as it started")
        except BaseException:
            transport.close()
            if child is not None:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await asyncio.to_thread(child.wait)
            raise
        pipes = (stdout, transport, protocol)
        return cls(pid, pidfd, pipes, marker_token, pid_namespace, child, reusable, later_mounts)

    @staticmethod
    async def _ready(stdout: asyncio.StreamReader, zygote: Zygote | None) -> tuple[int, bool, bool]:
        """The server's pid, whether it is reusable and whether its commands see later mounts, from its
        first line."""
        try:
            line = await asyncio.wait_for(stdout.readline(), SPAWN_TIMEOUT_S)
        except TimeoutError:
            raise OSError(f"no supervisor server within {SPAWN_TIMEOUT_S:.0f} s") from None
        try:
            message = json.loads(line) if line else {}
            return int(message["ready"]), message.get("reusable") is True, message.get("later_mounts") is True
        except (ValueError, KeyError, TypeError):
            pass
        if zygote is not None and not line and await zygote.ended(ZYGOTE_EXIT_S):
            raise ZygoteGone(f"the fork server (pid {zygote.pid}) exited with status {zygote.returncode}")
        what = str(message.get("error")) if isinstance(message, dict) and message else line.decode()[:200]
        raise OSError(f"the supervisor server did not start: {what or 'it ended at once'}")

    def _on_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        if self._child is not None:
            self._child.poll()  # reaped: the pidfd said it has ended
        if not self._exited.done():
            self._exited.set_result(None)

    @property
    def emptied_its_namespace(self) -> bool:
        """Whether the server has exited after its PID namespace ended with every process in it: nothing
        it ran can be left anywhere."""
        return self.pid_namespace and self._exited.done() and self._exit_code == 0

    @property
    def idle(self) -> bool:
        """No command of it runs, nor is being started."""
        return not self._live and not self._starting

    @property
    def alive(self) -> bool:
        return not self._closed and not self._exited.done()

    def _send(self, message: dict[str, Any]) -> None:
        """One request line to the server (supervisor_server.py's protocol)."""
        self._stdin.write(json.dumps(message).encode() + b"\n")

    async def spawn(self, params: dict[str, Any], env: dict[str, str]) -> ServedExec:
        """Fork a supervisor for ``params`` with the command's environment ``env``."""
        if self._closed:
            raise SandboxLostError("the sandbox's supervisor server has exited")
        req_id = next(self._ids)
        started: asyncio.Future[ServedExec] = asyncio.get_running_loop().create_future()
        self._starting[req_id] = started
        try:
            self._send({"id": req_id, "params": params, "env": env})
            await self._stdin.drain()
            return await asyncio.wait_for(asyncio.shield(started), SPAWN_TIMEOUT_S)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise SandboxLostError(f"the sandbox's supervisor server has exited: {exc}") from exc
        except TimeoutError as exc:
            self._abandoned.add(req_id)
            raise SandboxLostError(f"no fork from the server within {SPAWN_TIMEOUT_S:.0f} s") from exc
        except asyncio.CancelledError:
            self._abandoned.add(req_id)
            raise
        finally:
            self._starting.pop(req_id, None)

    def _tell(self, req_id: int, sig: int) -> None:
        """Pass ``sig`` to the command ``req_id`` its server supervises itself."""
        if not self._stdin.is_closing():
            self._send({"id": req_id, "signal": int(sig)})

    def prepare_view(self, steps: list[list[str]]) -> None:
        """Have the server build the sandbox's filesystem view now, which its commands then join
        (supervisor_server.py); no answer, and nothing lost if it cannot: each command's init then
        builds its own."""
        if not self._closed:
            self._send({"view": steps})

    async def _read(self) -> None:
        try:
            while line := await self._stdout.readline():
                self._dispatch(json.loads(line))
        except (ValueError, OSError) as exc:
            log.warning("supervisor server %d: unreadable answer: %s", self.pid, str(exc)[:200])
        finally:
            # The server is gone: nothing more starts, and what was running will not be reported.
            self._closed = True
            for started in self._starting.values():
                if not started.done():
                    started.set_exception(SandboxLostError("the sandbox's supervisor server has exited"))
            for served in self._live.values():
                served._end(None)
            if self._handed_on is not None and not self._handed_on.done():
                self._handed_on.set_exception(SandboxLostError("the supervisor server has exited"))

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "exit" in message:
            self._exit_code = int(message["exit"])
            return
        if "next" in message:
            if self._handed_on is not None and not self._handed_on.done():
                self._handed_on.set_result(None)
            return
        req_id = int(message["id"])
        started = self._starting.get(req_id)
        if "pid" in message:
            tell = functools.partial(self._tell, req_id) if message.get("folded") else None
            served = self._live[req_id] = ServedExec(int(message["pid"]), self._marker, tell)
            if req_id in self._abandoned:
                self._abandoned.discard(req_id)
                served.send_signal(signal.SIGTERM)  # nobody waits for it: it ends its tree and exits
            elif started is not None and not started.done():
                started.set_result(served)
        elif "error" in message:
            if started is not None and not started.done():
                started.set_exception(SandboxError(f"cannot start a command: {str(message['error'])[:500]}"))
        elif "status" in message and (served := self._live.pop(req_id, None)) is not None:
            served._end(int(message["status"]))

    async def hand_on(self, timeout: float) -> bool:
        """End the sandbox's use of a reusable server, which then serves another: True once the server
        says its PID namespace is empty (every process of the sandbox killed and reaped; the kernel keeps
        nothing of them there), its views and the uid's lock let go. False where it is not reusable, or
        could not say so within ``timeout``: it is then closed (``close``) as any other."""
        if not self.reusable or self._closed or self._live or self._starting or self._stdin.is_closing():
            await self.close(timeout)
            return False
        answered = self._handed_on = self.loop.create_future()
        token = uuid.uuid4().hex  # each sandbox its own marker, as a new server's
        self._send({"next": token})
        try:
            await asyncio.wait_for(asyncio.shield(answered), timeout)
            self.marker_token, self._marker = token, marker_entry(token)
            return True
        except (TimeoutError, SandboxLostError):
            await self.close(timeout)
            return False
        finally:
            self._handed_on = None

    async def close(self, timeout: float) -> None:
        """No more commands: the server exits once its supervisors have; forced past ``timeout``."""
        self._closed = True
        if not self._stdin.is_closing():
            self._stdin.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), timeout)
        except TimeoutError:
            if not self._exited.done():  # the pidfd names it until we close it, whoever reaps it
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._exited), KILLED_EXIT_S)
        if not self._reader.done():  # its answers end with it (cancelled past the bound)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reader, KILLED_EXIT_S)
        elif not self._reader.cancelled():
            await self._reader


def _spawn_server(
    env: dict[str, str],
    log_path: Path,
    pid_namespace: bool,
    network_forward: tuple[int, str] | None,
    stdin: int,
    stdout: int,
) -> subprocess.Popen[bytes]:
    """A supervisor server as a new interpreter, where there is no fork server."""
    network = ["--network", str(network_forward[0]), network_forward[1]] if network_forward else []
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as server_log:
        # -I keeps PYTHON* variables of the sandbox's environment from steering the interpreter; -S skips
        # site start-up, which a standard-library-only script does not need.
        return subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                SERVER_PATH,
                "--serve",
                str(os.getpid()),
                *(["--pid-namespace", *network] if pid_namespace else []),
            ],
            stdin=stdin,
            stdout=stdout,
            stderr=server_log,
            cwd="/",
            env=env,
            start_new_session=True,
        )
