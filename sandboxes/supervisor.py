"""The per-exec supervisor, and the /proc process-tree helpers it shares with the local sandbox.

Run as ``python3 -I -S supervisor.py PARAMS.json`` with the command's environment as its own. It runs one
command in a session of its own, pumps the command's output into capped files, enforces the timeout and
the sandbox's TTL, and before it exits kills every process the command left behind, then writes a small
JSON result. Standard library only, so it runs under any python3 the host has, and light on imports,
since every exec pays for its start-up.
"""

from __future__ import annotations

import binascii
import ctypes
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

POLL_S = 0.02
KILL_ROUNDS = 20  # bounds on every kill loop: a fork bomb must not keep us here forever
FREEZE_ROUNDS = 50
KILL_SETTLE_S = 0.5  # how long one SIGKILL round waits for the kernel to tear processes down
DRAIN_S = 2.0  # bound on reading what is left in the pipes after the tree is gone
READ_CHUNK = 64 * 1024


# ---------------------------------------------------------------------------------------------------------
# /proc helpers (also used by sandboxes.local from the worker side)


class ProcInfo(NamedTuple):
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    start_ticks: int

    @property
    def alive(self) -> bool:
        # A zombie has already died; it only waits for its parent to collect its status.
        return self.state not in ("Z", "X")


def read_proc(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses; the fields after its last ")" are fixed.
    fields = data[data.rindex(b")") + 2 :].split()
    return ProcInfo(
        pid=pid,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        state=fields[0].decode(),
        start_ticks=int(fields[19]),
    )


def snapshot() -> dict[int, ProcInfo]:
    procs: dict[int, ProcInfo] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = read_proc(int(name))
            if info is not None:
                procs[info.pid] = info
    return procs


def descendants(procs: dict[int, ProcInfo], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for info in procs.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def has_env_entry(pid: int, entry: bytes) -> bool:
    """Whether the process was started with ``entry`` (``NAME=value``) in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return entry in data.split(b"\0")


def send(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_processes(find: Callable[[], set[int]], *, grace_s: float, idle: Callable[[float], None]) -> bool:
    """End every process ``find`` reports: SIGTERM and ``grace_s`` to exit, then freeze and SIGKILL.

    ``find`` is re-evaluated every round so children forked meanwhile are caught too; ``idle(seconds)``
    waits (and may reap or pump meanwhile). Returns whether nothing was left. Every loop is bounded.
    """
    if grace_s > 0 and (pids := find()):
        send(pids, signal.SIGTERM)
        send(pids, signal.SIGCONT)  # a stopped process only acts on SIGTERM once continued
        wait_gone(find, grace_s, idle)
    for _ in range(KILL_ROUNDS):
        pids = find()
        if not pids:
            return True
        send(_freeze(find, pids), signal.SIGKILL)
        wait_gone(find, KILL_SETTLE_S, idle)
    return not find()


def _freeze(find: Callable[[], set[int]], pids: set[int]) -> set[int]:
    # SIGSTOP first, until no new pid shows up: a stopped process cannot fork, so the SIGKILL that
    # follows leaves no child to be reparented out of reach between two walks.
    stopped: set[int] = set()
    for _ in range(FREEZE_ROUNDS):
        new = pids - stopped
        if not new:
            break
        send(new, signal.SIGSTOP)
        stopped |= new
        pids = find()
    return stopped | pids


def wait_gone(find: Callable[[], set[int]], timeout: float, idle: Callable[[float], None]) -> bool:
    deadline = time.monotonic() + timeout
    while find():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        idle(min(POLL_S, remaining))
    return True


# ---------------------------------------------------------------------------------------------------------
# The supervisor proper


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}) failed: {os.strerror(err)}")


class _Pump:
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


class Supervisor:
    def __init__(self, params: dict[str, Any]) -> None:
        self.p = params
        self.me = os.getpid()
        self.terminated_by: int | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.child_status: int | None = None
        self.sel = selectors.DefaultSelector()
        self.pumps: dict[int, _Pump] = {}
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        self.wake_r = wake_r
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        self.sel.register(wake_r, selectors.EVENT_READ)

    def install_signals(self) -> None:
        def on_stop(signum: int, _frame: object) -> None:
            if self.terminated_by is None:
                self.terminated_by = signum

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, on_stop)
        # A handler (not SIG_DFL) so that SIGCHLD writes to the wakeup fd and ends a select().
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)

    def bind_lifetime(self) -> None:
        # SIGTERM (not SIGKILL) when the worker thread that started us dies: the handler above still
        # kills the tree before we exit.
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != self.p["parent_pid"]:
            self.terminated_by = signal.SIGTERM  # the worker died before the line above took effect
        # Orphans of the command (daemonized, double-forked) are reparented to us, not to init.
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        if os.getsid(0) != self.me:
            os.setsid()
        nofile = int(self.p["nofile_limit"])
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY:
            nofile = min(nofile, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def spawn(self) -> None:
        p = self.p
        memory = p.get("memory_limit_bytes")

        def limit_child() -> None:  # runs in the forked child; we are single-threaded, so this is safe
            if memory:
                resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stdin_path = p.get("stdin_path") or os.devnull
        stdin_fd = os.open(stdin_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.child = subprocess.Popen(
                p["argv"],
                cwd=p["cwd"],
                stdin=stdin_fd,
                stdout=out_w,
                stderr=err_w,
                close_fds=True,
                process_group=0,  # its own group in our session, so killpg reaches it in one call
                preexec_fn=limit_child,
            )
        finally:
            for fd in (out_w, err_w, stdin_fd):
                os.close(fd)
            for fd, path in ((out_r, p["stdout_path"]), (err_r, p["stderr_path"])):
                self.pumps[fd] = _Pump(fd, path, int(p["output_cap_bytes"]), int(p["tail_bytes"]))
                self.sel.register(fd, selectors.EVENT_READ)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.child is not None and pid == self.child.pid:
                self.child_status = status
                self.child.returncode = os.waitstatus_to_exitcode(status)

    def idle(self, timeout: float) -> None:
        """Wait up to ``timeout`` for output, a signal or a child's exit; move any output."""
        for key, _events in self.sel.select(timeout):
            fd = key.fd
            if fd == self.wake_r:
                try:
                    while os.read(fd, 512):
                        pass
                except BlockingIOError:
                    pass
            elif not self.pumps[fd].read():
                self.sel.unregister(fd)
        self.reap()

    def run_until_done(self) -> str:
        timeout_at = time.monotonic() + float(self.p["timeout_s"])
        ttl_at = time.monotonic() + (float(self.p["deadline_epoch"]) - time.time())
        while True:
            self.reap()
            # Told to stop outranks the command's exit: a tree killed from outside is no clean exit.
            if self.terminated_by is not None:
                return "terminated"
            if self.child_status is not None:
                return "exited"
            now = time.monotonic()
            if now >= timeout_at:
                return "timeout"
            if now >= ttl_at:
                return "deadline"
            self.idle(min(timeout_at, ttl_at) - now)

    def tree(self) -> set[int]:
        return self._tree(snapshot())

    def _tree(self, procs: dict[int, ProcInfo]) -> set[int]:
        mine = descendants(procs, self.me)
        # Members of our session that a walk would miss cannot exist while we live, but this is cheap.
        mine |= {info.pid for info in procs.values() if info.sid == self.me}
        mine.discard(self.me)
        return {pid for pid in mine if procs[pid].alive}

    def kill_tree(self) -> bool:
        child = self.child
        if child is not None:
            # While any member of the command's group lives its pgid cannot be reused, so this
            # signal cannot reach a stranger.
            procs = snapshot()
            if any(procs[pid].pgid == child.pid for pid in self._tree(procs)):
                try:
                    os.killpg(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        return kill_processes(self.tree, grace_s=float(self.p["kill_grace_s"]), idle=self.idle)

    def drain(self) -> None:
        deadline = time.monotonic() + DRAIN_S
        while len(self.sel.get_map()) > 1 and (remaining := deadline - time.monotonic()) > 0:
            self.idle(remaining)

    def result(self, reason: str, clean: bool, error: str | None) -> dict[str, Any]:
        exit_code = sig = None
        if self.child_status is not None:
            code = os.waitstatus_to_exitcode(self.child_status)
            exit_code, sig = (code, None) if code >= 0 else (None, -code)
        out: dict[str, Any] = {
            "reason": reason,
            "timed_out": reason in ("timeout", "deadline"),
            "terminated_by": self.terminated_by,
            "exit_code": exit_code,
            "signal": sig,
            "clean": clean,
            "error": error,
        }
        for pump, prefix in zip(self.pumps.values(), ("stdout", "stderr"), strict=False):
            out.update(pump.report(prefix))
        return out


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _spawn_failure(params: dict[str, Any], exc: OSError) -> dict[str, Any]:
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


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as f:
        params = json.load(f)
    sup = Supervisor(params)
    sup.install_signals()
    reason, error = "error", None
    spawn_failure: OSError | None = None
    try:
        sup.bind_lifetime()
        if sup.terminated_by is not None:
            reason = "terminated"
        else:
            try:
                sup.spawn()
            except OSError as exc:
                spawn_failure = exc
            else:
                reason = sup.run_until_done()
    except BaseException as exc:
        error = f"supervisor: {type(exc).__name__}: {exc}"
        raise
    finally:
        # Whatever happened above, nothing the command started may outlive us.
        clean = sup.kill_tree()
        sup.drain()
        sup.reap()
        for pump in sup.pumps.values():
            pump.close()
        if spawn_failure is not None:
            result = _spawn_failure(params, spawn_failure)
        else:
            result = sup.result(reason, clean, error)
        _write_json_atomic(params["result_path"], result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
