"""A command its sandbox's server supervises itself, with no supervisor process between them.

A supervisor (supervisor.py) is a forked interpreter per command: its fork, the pages it writes and its
exit cost ~2 ms of the machine's CPU a command beyond what its work costs in the server, for what is
mostly waiting. Where the server is the init of its sandbox's PID
namespace (namespaces.ServerInit) it already takes in every orphan of the namespace, so it can own a
command the way a supervisor does: it forks the command's init (spawn.py) into a session of its own,
pumps the command's output into capped files, ends it at its timeout, the sandbox's TTL or the worker's
word (a ``signal`` request on its pipe), and at its end kills every process the command left behind, then
writes the result a supervisor writes.

What the command left behind is every process of the namespace but the server and the trees of the
supervisors running beside it (each a subreaper, so whatever their commands start stays below them):
no session, process group or name the agent can change decides it. The server folds a request only where
no other command of the sandbox runs at its start (a command started while it runs gets a supervisor),
and whose commands join the view the server built; a request's step before its command (the diff before
the verifier) runs the same way first.

Standard library only, like the server that imports it.
"""

from __future__ import annotations

import os
import select
import sys
import time

if __package__:
    from sandboxes import native_init, proctree, spawn, supervisor
else:  # imported by the server run by path, with its directory on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import native_init
    import proctree
    import spawn
    import supervisor

# How long the server waits for a command's init to become the command (``FoldedCommand.start``): the
# init's own steps take a millisecond or two; past this (a host too busy to have run it yet), we go on.
EXEC_WAIT_S = 2.0

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Collection
    from typing import Any


def can_fold(params: dict[str, Any]) -> bool:
    """Whether a command's ``params`` allow its server to supervise it itself: an init of its own
    (spawn.needs_init) that joins the sandbox's view, and no network of its own."""
    shared_view = not params.get("view") or params.get("view_fds")
    return bool(spawn.needs_init(params) and shared_view and not params.get("network_forward"))


class FoldedExec:
    """One exec request the server supervises itself: its step before (``before``), if any, then its
    command, each a ``FoldedCommand`` in turn, as supervisor.run() runs them; its result written once the
    last has ended. ``prepare`` (namespaces.ServerInit.enter) runs first in each command's forked init;
    the native init takes its steps itself (``_start_native``)."""

    def __init__(
        self,
        params: dict[str, Any],
        env: dict[str, str] | None,
        proc: str,
        supervisors: Callable[[], Collection[int]],
        prepare: Callable[[], None],
    ) -> None:
        self.result_path = params["result_path"]
        self.steps = supervisor.split_steps(params, env)
        self.proc = proc
        self.supervisors = supervisors
        self.prepare = prepare
        self.results: list[dict[str, Any]] = []
        self.current: FoldedCommand | None = None
        self.terminated_by: int | None = None

    @property
    def pid(self) -> int:
        """The running command's pid (the namespace's), 0 when none runs."""
        return self.current.pid if self.current is not None else 0

    def start(self) -> bool:
        """Start the next command; True once none is left to run (the result then written)."""
        while len(self.results) < len(self.steps):
            params, env = self.steps[len(self.results)]
            if self.terminated_by is not None:  # the worker's word came during the step before
                ended = supervisor.command_result("terminated", True, None, None, self.terminated_by, ())
                self.results.append({**ended, "duration_s": 0.0})
                continue
            command = FoldedCommand(params, self.proc, self.supervisors)
            try:
                command.start(env, self.prepare)
            except OSError as exc:  # as a shell would say, as a supervisor says of one it cannot start
                self.results.append({**supervisor.spawn_failure(params, exc), "duration_s": 0.0})
                continue
            self.current = command
            return False
        result = self.results[-1]
        if len(self.results) > 1:
            result = {**result, "before": self.results[0]}
        supervisor.write_json_atomic(self.result_path, result)
        return True

    def signal(self, sig: int) -> None:
        if sig in supervisor.STOP_SIGNALS and self.terminated_by is None:
            self.terminated_by = sig
        if self.current is not None:
            self.current.signal(sig)

    def advance(self, now: float, wake: int, reap: Callable[[], None]) -> bool:
        """Finish the running command if its run is over and start the next; True once the request is
        done (its result written). Blocks for a command's kill bound at most."""
        command = self.current
        if command is None:
            return self.start()
        reason = command.reason(now)
        if reason is None:
            return False
        self.results.append(command.finish(reason, wake, reap))  # reaped as the current one meanwhile
        self.current = None
        return self.start()


def _start_native(
    p: dict[str, Any], env: dict[str, str] | None, stdin_fd: int, out_w: int, err_w: int
) -> int | None:
    """The command started under the native init (native_init.py) where it fits, which takes the steps
    of ``limit_process`` and of the server's ``prepare`` (namespaces.ServerInit.enter: no CAP_SYS_ADMIN)
    itself; None where it does not fit or cannot be spawned (spawn.py's init is then forked)."""
    if not native_init.fits(p):
        return None
    try:
        return native_init.start(p, env, stdin_fd, out_w, err_w)
    except OSError as exc:  # the program gone since the server's start, say: the forked init does it all
        os.write(2, f"supervisor server: native init: {exc}\n"[: proctree.CHILD_ERROR_CHARS].encode())
        return None


class FoldedCommand:
    """One command (or step) the server runs to its end. ``proc``: the namespace's procfs (a path);
    ``supervisors``: the pids (the namespace's) of the supervisors running now, whose trees are not this
    command's."""

    def __init__(self, params: dict[str, Any], proc: str, supervisors: Callable[[], Collection[int]]) -> None:
        self.p = params
        self.proc = proc
        self.supervisors = supervisors
        self.pid = 0
        self.started = time.monotonic()
        self.timeout_at = self.started + float(params["timeout_s"])
        self.ttl_at = self.started + (float(params["deadline_epoch"]) - time.time())
        self.terminated_by: int | None = None
        self.expired = False
        self.status: int | None = None  # the command's wait status, once reaped
        self.pumps: dict[int, supervisor.Pump] = {}
        self.open_fds: set[int] = set()  # pumps not at their end yet

    def start(self, env: dict[str, str] | None, prepare: Callable[[], None]) -> None:
        """Start the command's init: the native one where it fits, else forked (``prepare`` runs in it
        first). Raises OSError where the command cannot be started; nothing is then left open."""
        p = self.p
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stdin_fd = -1
        try:
            # Its files and input opened before the fork: a command that starts has an owner.
            cap, tail = int(p["output_cap_bytes"]), int(p["tail_bytes"])
            for fd, path in ((out_r, p["stdout_path"]), (err_r, p["stderr_path"])):
                self.pumps[fd] = supervisor.Pump(fd, path, cap, tail)
            stdin_fd = os.open(p.get("stdin_path") or os.devnull, os.O_RDONLY | os.O_CLOEXEC)

            def setup() -> None:
                for fd in (out_r, err_r):
                    os.close(fd)
                supervisor.limit_process(p)
                prepare()

            status_r = None
            pid = _start_native(p, env, stdin_fd, out_w, err_w)
            if pid is None:
                child, status_r = spawn._start_init(p, env, stdin_fd, out_w, err_w, setup)
                pid = child.pid
        except BaseException:
            for fd in (out_r, err_r):
                if (pump := self.pumps.pop(fd, None)) is not None:
                    pump.close()
                else:
                    os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, stdin_fd):
                if fd >= 0:
                    os.close(fd)
        if status_r is not None:
            # The init becomes the command (it runs no forwarder of its own: the server relays), so the
            # server reaps the command itself and the status pipe carries nothing; its end closes at the
            # init's exec (or death). Until then we wait: every page we wrote meanwhile, the init still
            # sharing it, the kernel would copy (a server that serves sandbox after sandbox has made its
            # pages its own, and would have each copied again at each command).
            select.select([status_r], [], [], EXEC_WAIT_S)
            os.close(status_r)
        self.pid = pid
        self.open_fds.update(self.pumps)

    def read(self, fd: int) -> bool:
        """Move what the pipe ``fd`` holds; False at its end (the caller stops watching it)."""
        if self.pumps[fd].read():
            return True
        self.open_fds.discard(fd)
        return False

    def signal(self, sig: int) -> None:
        """The worker's word: a stop signal ends the command as terminated, the expire signal as if its
        timeout had passed."""
        if sig == supervisor.EXPIRE_SIGNAL:
            self.expired = True
        elif sig in supervisor.STOP_SIGNALS and self.terminated_by is None:
            self.terminated_by = sig

    def reason(self, now: float) -> str | None:
        """Why the command's run is over, or None while it is not."""
        stopped, exited = self.terminated_by is not None, self.status is not None
        return supervisor.end_reason(stopped, exited, self.expired, now, self.timeout_at, self.ttl_at)

    def due(self) -> float:
        """When (monotonic) its timeout or the TTL falls."""
        return min(self.timeout_at, self.ttl_at)

    def finish(self, reason: str, wake: int, reap: Callable[[], None]) -> dict[str, Any]:
        """End what is left of the command (SIGTERM, its grace, then SIGKILL), take what its pipes still
        hold (bounded), and return its result. ``wake``: readable on a SIGCHLD; ``reap`` reaps the
        server's children (ours among them). Blocks for the kill's bound at most."""

        def idle(timeout: float) -> None:
            ready = select.select([wake, *self.open_fds], [], [], timeout)[0]
            for fd in ready:
                if fd == wake:
                    supervisor.drain_wakeup(wake)
                else:
                    self.read(fd)
            reap()

        clean = proctree.kill_processes(self.left, grace_s=float(self.p["kill_grace_s"]), idle=idle)
        reap()
        deadline = time.monotonic() + supervisor.DRAIN_S
        while self.open_fds and (remaining := deadline - time.monotonic()) > 0:
            idle(remaining)
        result = supervisor.command_result(
            reason, clean, None, self.status, self.terminated_by, self.pumps.values()
        )
        result["duration_s"] = time.monotonic() - self.started
        for pump in self.pumps.values():
            pump.close()
        self.open_fds.clear()
        return result

    def left(self) -> set[int]:
        """The namespace's living processes that are not the server's (pid 1) nor below a running
        supervisor: what this command (or one it followed) left."""
        try:
            names = os.listdir(self.proc)  # bounded by the sandbox's process cap
        except OSError:
            return set()
        procs = {}
        for name in names:
            if name.isdigit() and name != "1" and (info := proctree.read_proc(int(name), self.proc)):
                procs[info.pid] = info
        for sup in set(self.supervisors()) & procs.keys():
            for pid in (sup, *proctree.descendants(procs, sup)):
                procs.pop(pid, None)
        return {pid for pid, info in procs.items() if info.alive}
