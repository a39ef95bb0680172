"""The agent's supervisors, each forked by one pre-imported supervisor server (supervisor_server.py,
with no PID namespace of its own) rather than started as an interpreter of its own for each command:
``python3 -I -S supervisor.py PARAMS`` costs ~20 ms of CPU and of the exec's wall (the interpreter's
start and the supervisor's imports), a fork of the server ~1-2 ms.

The agent starts the server beside its own start (``warm``), else at its first exec, as

    python3 -I -S supervisor_server.py --serve AGENT_PID

from /, with an environment of one marker entry of its own (``MARKER_VAR``) and no descriptor of the
agent's (its token, its sockets). Each exec is one request line, its command's environment in it (never
in the server's, nor in a file); a supervisor the server forks runs ``supervisor.run`` exactly as the
interpreter did, writes its result where the request says, and the server reports its exit status. The
server watches the agent through a pidfd: the agent's death ends it, and each supervisor ends its tree
on its server's death. A server that is lost is started again at the next exec; one that cannot start
at all leaves the agent to start an interpreter per command, as before.

Standard library only, and python3 >= 3.8 to import, like agent_commands.py; the server itself needs
the supervisor's python3 >= 3.11.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import threading
import time

try:  # as part of the package
    from sandboxes import proctree
except ImportError:  # copied beside agent.py into a sandbox
    import proctree  # type: ignore[no-redef]

SERVER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor_server.py")
MARKER_VAR = "ROLLOUT_SANDBOX"  # what supervisor_server.py carries its marker in
READY_TIMEOUT_S = 30.0  # for the server's first line: an interpreter's start, on a loaded node
SPAWN_TIMEOUT_S = 30.0  # for a fork's answer
MAX_ANSWER_BYTES = 64 * 1024  # a line of the server's is a few dozen bytes


class ServerLost(OSError):
    """There is no supervisor server to be had: the command was not started, and may be another way."""


class RequestLost(OSError):
    """The supervisor server was lost with the request: whether its command started is not known."""


class ServedSupervisor:
    """One supervisor the server forked: the part of ``subprocess.Popen`` the agent uses. ``returncode``
    is its exit code once the server has reported it (-1 where the server was lost first)."""

    def __init__(self, pid: int, marker: bytes) -> None:
        self.pid = pid
        self.args = ["supervisor", str(pid)]  # what a TimeoutExpired names
        self.returncode = None  # type: int | None
        self._marker = marker
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self._ended.is_set():
            return
        # The server reaps the supervisor before we hear of it: the marker check keeps a signal from a
        # process that took over its pid in between.
        if proctree.has_env_entry(self.pid, self._marker):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def _end(self, status: int | None) -> None:
        if not self._ended.is_set():
            self.returncode = -1 if status is None else os.waitstatus_to_exitcode(status)
            self._ended.set()


class SupervisorServer:
    """The agent's supervisor server: started at the first ``spawn``, again after it is lost."""

    def __init__(self, python: list, log_path: str) -> None:
        self._python = python
        self._log_path = log_path
        self._lock = threading.Lock()  # the server's start, its request pipe, the tables below
        self._proc = None  # type: subprocess.Popen | None
        self._ids = 0
        self._starting = {}  # type: dict[int, list]  # request id -> [event, supervisor or error]
        self._live = {}  # type: dict[int, ServedSupervisor]
        self._token = secrets.token_hex(16)
        self._marker = (MARKER_VAR + "=" + self._token).encode()
        self.failed = False  # could not start: the caller starts an interpreter per command instead

    def warm(self) -> None:
        """Start the server now, in a thread, so that the first exec finds it ready."""

        def start() -> None:
            with self._lock:
                try:
                    self._running_server()
                except OSError:
                    pass  # the first exec starts an interpreter of its own instead

        threading.Thread(target=start, name="supervisor-server-start", daemon=True).start()

    def spawn(self, params: dict, env: dict, log_path: str) -> ServedSupervisor:
        """Have the server fork a supervisor for ``params`` (supervisor.py's, ``cwd`` its working
        directory) with the command's environment ``env``, its own stderr appended to ``log_path``.
        Raises ServerLost where there is no server to be had (nothing was started), RequestLost where it
        was lost with the request, OSError where it could not fork."""
        with self._lock:
            proc = self._running_server()
            self._ids += 1
            req_id = self._ids
            waiter = [threading.Event(), None]  # type: list
            self._starting[req_id] = waiter
            line = json.dumps({"id": req_id, "params": dict(params, log_path=log_path), "env": env})
            try:
                assert proc.stdin is not None
                proc.stdin.write(line.encode() + b"\n")
                proc.stdin.flush()
            except OSError as exc:  # its reading end closed: it exited before it read this
                self._starting.pop(req_id, None)
                raise ServerLost(f"the supervisor server has exited: {exc}") from exc
        if not waiter[0].wait(SPAWN_TIMEOUT_S):
            with self._lock:
                self._starting.pop(req_id, None)  # a fork answered later is ended (``_dispatch``)
            raise RequestLost(f"no fork from the supervisor server within {SPAWN_TIMEOUT_S:.0f} s")
        answer = waiter[1]
        if isinstance(answer, ServedSupervisor):
            return answer
        raise answer

    def close(self, timeout: float) -> None:
        """End the server: no more requests; it exits once its supervisors have, bounded by ``timeout``."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            _reap(proc)  # its supervisors end their trees on its death

    def _running_server(self) -> subprocess.Popen:
        """The server, started if it is not running (the lock held)."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self.failed:
            raise ServerLost("the supervisor server could not start")
        try:
            self._proc = self._start()
        except OSError as exc:  # no python to start it with, no fork to be had, or it did not answer
            self.failed = True
            raise exc if isinstance(exc, ServerLost) else ServerLost(f"cannot start it: {exc}") from exc
        return self._proc

    def _start(self) -> subprocess.Popen:
        with open(self._log_path, "ab") as log:
            proc = subprocess.Popen(
                [*self._python, "-I", "-S", SERVER_PATH, "--serve", str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd="/",
                env={MARKER_VAR: self._token},
                start_new_session=True,
            )
        assert proc.stdout is not None
        try:
            ready = _first_line(proc.stdout.fileno(), READY_TIMEOUT_S)
            if not isinstance(json.loads(ready).get("ready"), int):
                raise ValueError(ready[:200])
        except (OSError, ValueError, AttributeError) as exc:
            _reap(proc)
            raise ServerLost(f"the supervisor server did not start: {exc}") from exc
        threading.Thread(target=self._read, args=(proc,), name="supervisor-server", daemon=True).start()
        return proc

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        try:
            while True:
                line = proc.stdout.readline(MAX_ANSWER_BYTES)
                if not line:
                    break  # its end: it closes its answers only by exiting
                try:
                    self._dispatch(json.loads(line))
                except (ValueError, KeyError, TypeError):
                    continue  # nothing of ours; its supervisors are still reported
        finally:
            # Gone: nothing more starts through it, and what ran will not be reported.
            with self._lock:
                if self._proc is proc:
                    self._proc = None  # the next spawn starts another
                for waiter in self._starting.values():
                    if waiter[1] is None:
                        waiter[1] = RequestLost("the supervisor server was lost while starting the command")
                    waiter[0].set()
                self._starting.clear()
                live, self._live = self._live, {}
            for served in live.values():
                served._end(None)
            _reap(proc)

    def _dispatch(self, message: dict) -> None:
        if "exit" in message:
            return
        req_id = int(message["id"])
        with self._lock:
            if "status" in message:
                served = self._live.pop(req_id, None)
                waiter = None
            else:
                waiter = self._starting.pop(req_id, None)
                served = None
                if "pid" in message:
                    served = ServedSupervisor(int(message["pid"]), self._marker)
                    self._live[req_id] = served
        if "status" in message:
            if served is not None:
                served._end(int(message["status"]))
            return
        if waiter is None:  # abandoned (its spawn gave up waiting): nobody waits for it
            if served is not None:
                served.send_signal(signal.SIGTERM)
            return
        waiter[1] = served if served is not None else OSError(str(message.get("error", "no fork"))[:500])
        waiter[0].set()


def _reap(proc: subprocess.Popen) -> None:
    """Kill ``proc`` where it still runs, and reap it."""
    try:
        proc.kill()
    except OSError:
        pass
    proc.wait()


def _first_line(fd: int, timeout: float) -> str:
    """The first line on ``fd``, waited for at most ``timeout`` seconds; ValueError without one."""
    deadline = time.monotonic() + timeout
    data = b""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while b"\n" not in data and len(data) < MAX_ANSWER_BYTES:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(int(left * 1000) + 1):
            raise ValueError(f"no answer within {timeout:.0f} s")
        chunk = os.read(fd, 1)  # byte by byte: what follows the line is the reader thread's
        if not chunk:
            raise ValueError(f"it exited: {data[:200]!r}")
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")
