"""The worker's side of a local sandbox's supervisor server (``supervisor_server.py --serve``).

One server process per sandbox forks a supervisor for each command, so a command costs a fork instead
of an interpreter start-up and the supervisor's imports (tens of milliseconds, several times per
rollout). The protocol is described beside the server in ``supervisor_server.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from sandboxes import proctree
from sandboxes.base import SandboxError, SandboxLostError
from sandboxes.environment import marker_entry

log = logging.getLogger(__name__)

SERVER_PATH = str(Path(__file__).resolve().with_name("supervisor_server.py"))
# How long a fork may take to be acknowledged: the server may still be starting on a loaded host.
SPAWN_TIMEOUT_S = 120.0


class ServedExec:
    """One forked supervisor: the part of ``asyncio.subprocess.Process`` the sandbox uses."""

    def __init__(self, pid: int, marker: bytes) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._marker = marker
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def ended(self) -> bool:
        return self._ended.done()

    async def wait(self) -> int | None:
        await asyncio.shield(self._ended)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # The server reaps the supervisor before we hear of it; the marker check keeps a signal from
        # reaching a process that took over the pid in between.
        if not self._ended.done() and proctree.has_env_entry(self.pid, self._marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def _end(self, status: int | None) -> None:
        if not self._ended.done():
            self.returncode = None if status is None else os.waitstatus_to_exitcode(status)
            self._ended.set_result(None)


class ExecServer:
    """A running supervisor server. Build it with ``ExecServer.start``."""

    def __init__(self, proc: asyncio.subprocess.Process, marker_token: str, pid_namespace: bool) -> None:
        self._proc = proc
        self.pid_namespace = pid_namespace
        self.marker_token = marker_token
        self._marker = marker_entry(marker_token)
        self._ids = itertools.count(1)
        self._starting: dict[int, asyncio.Future[ServedExec]] = {}
        self._live: dict[int, ServedExec] = {}
        self._abandoned: set[int] = set()  # requests whose caller was cancelled before the fork was told
        self._closed = False
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(
        cls,
        *,
        cwd: str,
        env: dict[str, str],
        marker_token: str,
        log_path: Path,
        pid_namespace: bool = False,
        network_forward: tuple[int, str] | None = None,
    ) -> ExecServer:
        """``env`` must carry the marker: /proc/PID/environ of the server and of every supervisor it
        forks shows it, which is how the sandbox finds its processes. ``pid_namespace``: every command
        runs in one PID namespace, made by the server at its start (see namespaces.py); with
        ``network_forward`` (port, gateway socket), in one loopback-only network namespace too."""
        network = ["--network", str(network_forward[0]), network_forward[1]] if network_forward else []
        # -I keeps PYTHON* variables of the sandbox's environment from steering the interpreter; -S skips
        # site start-up, which a standard-library-only script does not need.
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as server_log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                SERVER_PATH,
                "--serve",
                str(os.getpid()),
                *(["--pid-namespace", *network] if pid_namespace else []),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=server_log,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        return cls(proc, marker_token, pid_namespace)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def emptied_its_namespace(self) -> bool:
        """Whether the server has exited after its PID namespace ended with every process in it: nothing
        it ran can be left anywhere."""
        return self.pid_namespace and self._proc.returncode == 0

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.returncode is None

    async def spawn(self, params: dict[str, Any], env: dict[str, str]) -> ServedExec:
        """Fork a supervisor for ``params`` with the command's environment ``env``."""
        if self._closed or self._proc.stdin is None:
            raise SandboxLostError("the sandbox's supervisor server has exited")
        req_id = next(self._ids)
        started: asyncio.Future[ServedExec] = asyncio.get_running_loop().create_future()
        self._starting[req_id] = started
        try:
            self._proc.stdin.write(json.dumps({"id": req_id, "params": params, "env": env}).encode() + b"\n")
            await self._proc.stdin.drain()
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

    async def _read(self) -> None:
        assert self._proc.stdout is not None
        try:
            while line := await self._proc.stdout.readline():
                self._dispatch(json.loads(line))
        except (ValueError, OSError) as exc:
            log.warning("supervisor server %d: unreadable answer: %s", self._proc.pid, str(exc)[:200])
        finally:
            # The server is gone: nothing more starts, and what was running will not be reported.
            self._closed = True
            for started in self._starting.values():
                if not started.done():
                    started.set_exception(SandboxLostError("the sandbox's supervisor server has exited"))
            for served in self._live.values():
                served._end(None)

    def _dispatch(self, message: dict[str, Any]) -> None:
        req_id = int(message["id"])
        started = self._starting.get(req_id)
        if "pid" in message:
            served = self._live[req_id] = ServedExec(int(message["pid"]), self._marker)
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

    async def close(self, timeout: float) -> None:
        """No more commands: the server exits once its supervisors have; forced past ``timeout``."""
        self._closed = True
        if self._proc.stdin is not None and not self._proc.stdin.is_closing():
            self._proc.stdin.close()
        try:
            await asyncio.wait_for(self._proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()
        await self._reader
