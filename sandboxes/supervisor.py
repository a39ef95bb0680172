"""The per-command supervisor: one command run to its end, and nothing it started left behind.

A supervisor runs one command in a session of its own, pumps the command's output into capped files,
enforces the timeout and the sandbox's TTL, and before it exits kills every process the command left
behind, then writes a small JSON result. Two ways to start one:

- ``python3 -I -S supervisor.py PARAMS.json``, with the command's environment as its own (the in-sandbox
  agent's way where it has no server: agent_supervisors.py);
- forked by a server (``supervisor_server.py``: the local sandbox's, and the in-sandbox agent's), which
  calls ``run`` in the child, so a command costs a fork rather than an interpreter start-up and these
  imports. (A server
  that is its sandbox's PID-namespace init does this module's work itself for a command alone in the
  sandbox, with its pumps and result: folded.py.)

Standard library only, so it runs under any python3 >= 3.11 the host has; it needs its siblings
``proctree.py`` and ``spawn.py`` (how the command is started), which ship beside it.
"""

from __future__ import annotations

import binascii
import json
import os
import resource
import selectors
import signal
import sys
import time

if __package__:
    from sandboxes import proctree
    from sandboxes.spawn import (
        _Forked,
        _popen_limited,
        _reported_status,
        _spawn,
        _start_init,
        needs_init,
    )
else:  # run by path, or imported by the agent or the server run so: -I leaves our directory off sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import proctree
    from spawn import _Forked, _popen_limited, _reported_status, _spawn, _start_init, needs_init

# No `typing` or `subprocess` at start-up: the supervisor's server imports this module (see
# supervisor_server.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Iterable
    from typing import Any

DRAIN_S = 2.0  # bound on reading what is left in the pipes after the tree is gone
# A supervisor's own worst case past its command's timeout (start-up, every kill round, the pipe drain):
# only once that has passed too does its owner kill it from outside.
SLACK_S = 5.0 + proctree.KILL_ROUNDS * proctree.KILL_SETTLE_S + DRAIN_S
READ_CHUNK = 64 * 1024
STOP_SIGNALS = proctree.PASSED_SIGNALS  # passed on to the command by its init, as by any stand-in
# "Your timeout is now": the command ends as if its timeout had passed (timed out, not terminated). The
# owner sends it when a budget other than wall time runs out (limits.deadline_counts: agent).
EXPIRE_SIGNAL = signal.SIGUSR1
# Blocked by the server across a fork until the supervisor's own handlers are in place, so that a signal
# sent right after the fork is neither lost nor (SIGUSR1's default) fatal.
HANDLED_SIGNALS = (*STOP_SIGNALS, EXPIRE_SIGNAL)


class Pump:
    """Copies one pipe into a file up to a byte cap, then keeps reading (so the writer never blocks)."""

    def __init__(self, fd: int, path: str, cap: int, tail_bytes: int) -> None:
        self.fd = fd
        self.out: int | None = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        self.cap = cap
        self.tail_bytes = tail_bytes
        self.total = 0
        self.written = 0
        self.tail = bytearray()
        self.write_error: str | None = None
        os.set_blocking(fd, False)

    def read(self) -> bool:
        """Move what is available; False at end of file."""
        try:
            chunk = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self.total += len(chunk)
        room = self.cap - self.written
        if room > 0 and self.out is not None:
            self._write(chunk[:room])
        self.tail += chunk
        if len(self.tail) > self.tail_bytes:
            del self.tail[: len(self.tail) - self.tail_bytes]
        return True

    def _write(self, data: bytes) -> None:
        assert self.out is not None
        view = memoryview(data)
        try:
            while view:
                n = os.write(self.out, view)
                view = view[n:]
                self.written += n
        except OSError as exc:
            # A full disk must not stall the command on a full pipe: stop keeping, keep draining.
            self.write_error = str(exc)
            os.close(self.out)
            self.out = None

    def close(self) -> None:
        if self.out is not None:
            os.close(self.out)
            self.out = None
        os.close(self.fd)

    def report(self, prefix: str) -> dict[str, Any]:
        return {
            f"{prefix}_bytes": self.total,
            f"{prefix}_kept_bytes": self.written,
            f"{prefix}_tail_b64": binascii.b2a_base64(bytes(self.tail), newline=False).decode(),
            f"{prefix}_write_error": self.write_error,
        }


# ---------------------------------------------------------------------------------------------------------
# Signals, the server's too: a wake-up pipe that ends a select(), and the stop handlers


def signal_wakeup(sel: selectors.BaseSelector) -> tuple[int, int]:
    """A pipe that every signal writes a byte to, registered with ``sel``: a select() ends on a signal."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    sel.register(wake_r, selectors.EVENT_READ)
    return wake_r, wake_w


def drain_wakeup(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def handle_stop_signals(on_stop: Callable[[int, object], None]) -> None:
    for sig in STOP_SIGNALS:
        proctree.set_handler(sig, on_stop)
    # A handler (not SIG_DFL) so that SIGCHLD writes to the wakeup fd and ends a select().
    proctree.set_handler(signal.SIGCHLD, lambda _s, _f: None)


# ---------------------------------------------------------------------------------------------------------
# The supervisor proper


class Supervisor:
    def __init__(self, params: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.p = params
        self.env = env
        self.me = os.getpid()
        self.terminated_by: int | None = None
        self.expired = False  # EXPIRE_SIGNAL came: the command's timeout is now
        self.child: subprocess.Popen[bytes] | _Forked | None = None
        self.status_pipe: int | None = None  # the namespace init's report of the command's wait status
        self.child_status: int | None = None
        self.sel = selectors.DefaultSelector()
        self.pumps: dict[int, Pump] = {}
        self.wake_r, self.wake_w = signal_wakeup(self.sel)

    def install_signals(self) -> None:
        def on_stop(signum: int, _frame: object) -> None:
            if self.terminated_by is None:
                self.terminated_by = signum

        def on_expire(_signum: int, _frame: object) -> None:
            self.expired = True

        handle_stop_signals(on_stop)
        proctree.set_handler(EXPIRE_SIGNAL, on_expire)

    def bind_lifetime(self) -> None:
        # SIGTERM (not SIGKILL) when the worker thread that started us dies: the handler above still
        # kills the tree before we exit.
        proctree.prctl(proctree.PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != self.p["parent_pid"]:
            self.terminated_by = signal.SIGTERM  # the worker died before the line above took effect
        # Orphans of the command (daemonized, double-forked) are reparented to us, not to init.
        proctree.prctl(proctree.PR_SET_CHILD_SUBREAPER, 1)
        if os.getsid(0) != self.me:
            os.setsid()
        limit_process(self.p)

    def spawn(self) -> None:
        p = self.p
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stdin_path = p.get("stdin_path") or os.devnull
        stdin_fd = os.open(stdin_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if needs_init(p):
                self.child, self.status_pipe = _start_init(p, self.env, stdin_fd, out_w, err_w)
            elif p.get("memory_limit_bytes") or p.get("file_size_limit_bytes"):
                self.child = _popen_limited(p, self.env, stdin_fd, out_w, err_w)
            else:
                self.child = _Forked(_spawn(p["argv"], p["cwd"], self.env, stdin_fd, out_w, err_w))
        finally:
            for fd in (out_w, err_w, stdin_fd):
                os.close(fd)
            for fd, path in ((out_r, p["stdout_path"]), (err_r, p["stderr_path"])):
                self.pumps[fd] = Pump(fd, path, int(p["output_cap_bytes"]), int(p["tail_bytes"]))
                self.sel.register(fd, selectors.EVENT_READ)

    def reap(self) -> None:
        for pid, status in proctree.exited_children():
            if self.child is not None and pid == self.child.pid:
                if self.status_pipe is not None:
                    status = _reported_status(self.status_pipe, status)
                self.child_status = status
                self.child.returncode = os.waitstatus_to_exitcode(status)

    def idle(self, timeout: float) -> None:
        """Wait up to ``timeout`` for output, a signal or a child's exit; move any output."""
        for key, _events in self.sel.select(timeout):
            fd = key.fd
            if fd == self.wake_r:
                drain_wakeup(fd)
            elif not self.pumps[fd].read():
                self.sel.unregister(fd)
        self.reap()

    def run_until_done(self) -> str:
        timeout_at = time.monotonic() + float(self.p["timeout_s"])
        ttl_at = time.monotonic() + (float(self.p["deadline_epoch"]) - time.time())
        while True:
            self.reap()
            now = time.monotonic()
            stopped, exited = self.terminated_by is not None, self.child_status is not None
            if reason := end_reason(stopped, exited, self.expired, now, timeout_at, ttl_at):
                return reason
            self.idle(min(timeout_at, ttl_at) - now)

    def tree(self) -> set[int]:
        return self._tree(proctree.snapshot())

    def _tree(self, procs: dict[int, proctree.ProcInfo]) -> set[int]:
        mine = proctree.descendants(procs, self.me)
        # Members of our session that a walk would miss cannot exist while we live, but this is cheap.
        mine |= {info.pid for info in procs.values() if info.sid == self.me}
        mine.discard(self.me)
        return {pid for pid in mine if procs[pid].alive}

    def has_children(self) -> bool:
        """Whether any process of ours is left. As a subreaper we inherit every orphan below us, so a
        living descendant means a child of our own: no child, no tree, and no /proc walk needed."""
        self.reap()
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        return True

    def kill_tree(self) -> bool:
        if not self.has_children():
            return True
        child = self.child
        if child is not None:
            # While any member of the command's group lives its pgid cannot be reused, so this
            # signal cannot reach a stranger.
            procs = proctree.snapshot()
            if any(procs[pid].pgid == child.pid for pid in self._tree(procs)):
                try:
                    os.killpg(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        return proctree.kill_processes(self.tree, grace_s=float(self.p["kill_grace_s"]), idle=self.idle)

    def close(self) -> None:
        """Our pipes and selector; the next step of the exec, if any, makes its own."""
        for pump in self.pumps.values():
            pump.close()
        signal.set_wakeup_fd(-1)
        self.sel.close()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)

    def drain(self) -> None:
        deadline = time.monotonic() + DRAIN_S
        while len(self.sel.get_map()) > 1 and (remaining := deadline - time.monotonic()) > 0:
            self.idle(remaining)

    def result(self, reason: str, clean: bool, error: str | None) -> dict[str, Any]:
        status, by = self.child_status, self.terminated_by
        return command_result(reason, clean, error, status, by, self.pumps.values())


def end_reason(
    terminated: bool, exited: bool, expired: bool, now: float, timeout_at: float, ttl_at: float
) -> str | None:
    """Why a command's run is over (monotonic ``now`` against its timeout and the TTL), or None."""
    if terminated:  # told to stop outranks the command's exit: a tree killed from outside is no clean exit
        return "terminated"
    if exited:
        return "exited"
    if now >= timeout_at or expired:
        return "timeout"
    if now >= ttl_at:
        return "deadline"
    return None


def split_steps(
    params: dict[str, Any], env: dict[str, str] | None
) -> list[tuple[dict[str, Any], dict[str, str] | None]]:
    """The commands of one request, each with its environment: its step before (``before``: argv,
    timeout_s, stdout_path, stderr_path and env), if any, then its command."""
    before = params.get("before")
    if not before:
        return [(params, env)]
    step = {**params, **before, "before": None}
    return [(step, before.get("env", env)), (params, env)]


def limit_process(params: dict[str, Any]) -> None:
    """The command's descriptor limit (``nofile_limit``, within the hard one) and no core dumps, set on
    this process for the command it starts to inherit."""
    nofile = nofile_limit(params)
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def nofile_limit(params: dict[str, Any]) -> int:
    """The command's descriptor limit: its ``nofile_limit``, within our hard one."""
    nofile = int(params["nofile_limit"])
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return nofile if hard == resource.RLIM_INFINITY else min(nofile, hard)


def command_result(
    reason: str,
    clean: bool,
    error: str | None,
    status: int | None,
    terminated_by: int | None,
    pumps: Iterable[Pump],
) -> dict[str, Any]:
    """A command's result as its owner reads it: why it ended, its wait ``status`` (None: never
    reaped), whether nothing of it was left, and what its output ``pumps`` (stdout's, then stderr's) kept."""
    exit_code = sig = None
    if status is not None:
        code = os.waitstatus_to_exitcode(status)
        exit_code, sig = (code, None) if code >= 0 else (None, -code)
    out: dict[str, Any] = {
        "reason": reason,
        "timed_out": reason in ("timeout", "deadline"),
        "terminated_by": terminated_by,
        "exit_code": exit_code,
        "signal": sig,
        "clean": clean,
        "error": error,
    }
    for pump, prefix in zip(pumps, ("stdout", "stderr"), strict=False):
        out.update(pump.report(prefix))
    return out


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    proctree.write_small(tmp, json.dumps(data), create=True)
    os.replace(tmp, path)


def spawn_failure(params: dict[str, Any], exc: OSError) -> dict[str, Any]:
    # Report like a shell would (127 not found, 126 not executable), with the reason on stderr.
    message = f"cannot run {params['argv'][0]!r}: {exc.strerror or exc}\n".encode(errors="replace")
    with open(params["stderr_path"], "wb") as f:
        f.write(message)
    return {
        "reason": "spawn_failed",
        "timed_out": False,
        "exit_code": 127 if isinstance(exc, FileNotFoundError) else 126,
        "signal": None,
        "clean": True,
        "error": None,
        "stdout_bytes": 0,
        "stderr_bytes": len(message),
        "stderr_tail_b64": binascii.b2a_base64(message, newline=False).decode(),
    }


def run(params: dict[str, Any], env: dict[str, str] | None = None) -> int:
    """Supervise one command to its end and write its result; ``env`` is the command's environment
    (None: our own). With ``before`` (argv, timeout_s, stdout_path, stderr_path and env of a step), that
    step runs to its end first and its result goes under "before": two commands for one supervisor."""
    result: dict[str, Any] = {}
    previous: Supervisor | None = None
    failure: BaseException | None = None
    *before, (params, env) = split_steps(params, env)
    for step, step_env in before:
        result["before"], previous, failure = _supervise(step, step_env)
    if failure is None:
        main, _sup, failure = _supervise(params, env, previous)
        result.update(main)
    else:
        result.update(result["before"])
    write_json_atomic(params["result_path"], result)
    if failure is not None:
        raise failure
    return 0


def _supervise(
    params: dict[str, Any], env: dict[str, str] | None, previous: Supervisor | None = None
) -> tuple[dict[str, Any], Supervisor, BaseException | None]:
    """One command to its end: its result, its supervisor, and what went wrong in here, for the caller
    to raise once the result is written. A stop signal that reached ``previous`` (the step before)
    stops this one before it starts."""
    started = time.monotonic()
    sup = Supervisor(params, env)
    sup.install_signals()
    proctree.block_signals(signal.SIG_UNBLOCK, HANDLED_SIGNALS)  # blocked by the server across its fork
    if previous is not None:  # read after our handlers took over: no signal falls in between
        sup.terminated_by = previous.terminated_by
    reason, error = "error", None
    failed_start: OSError | None = None
    failure: BaseException | None = None
    try:
        sup.bind_lifetime()
        if sup.terminated_by is not None:
            reason = "terminated"
        else:
            try:
                sup.spawn()
            except OSError as exc:
                failed_start = exc
            else:
                reason = sup.run_until_done()
    except BaseException as exc:
        error = f"supervisor: {type(exc).__name__}: {exc}"
        failure = exc
    # Whatever happened above, nothing the command started may outlive us.
    clean = sup.kill_tree()
    sup.drain()
    sup.reap()
    sup.close()
    result = spawn_failure(params, failed_start) if failed_start else sup.result(reason, clean, error)
    result["duration_s"] = time.monotonic() - started
    return result, sup, failure


def main(argv: list[str]) -> int:
    proctree.name_process(b"rollout-sup")  # as a server's forked ones are: netns.py's chains end here
    with open(argv[1], encoding="utf-8") as f:
        params = json.load(f)
    return run(params)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
