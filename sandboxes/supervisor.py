"""The per-exec supervisor, and the /proc process-tree helpers it shares with the local sandbox.

A supervisor runs one command in a session of its own, pumps the command's output into capped files,
enforces the timeout and the sandbox's TTL, and before it exits kills every process the command left
behind, then writes a small JSON result. Two ways to start one:

- ``python3 -I -S supervisor.py PARAMS.json``, with the command's environment as its own (the in-sandbox
  agent does this);
- ``python3 -I -S supervisor.py --serve PARENT_PID [--pid-namespace]``: a server per sandbox that forks a
  supervisor for each command it is sent (the local sandbox, via sandboxes/exec_server.py), so a command
  costs a fork rather than an interpreter start-up and these imports; with ``--pid-namespace``, every
  command of the sandbox runs in one PID namespace the server makes at its start.

Standard library only, so it runs under any python3 >= 3.11 the host has.
"""

from __future__ import annotations

import binascii
import ctypes
import json
import os
import resource
import select
import selectors
import signal
import sys
import time

# Neither `typing` nor `subprocess` at start-up: every sandbox starts a server, and those two imports were
# a third of its ~60 ms of CPU, spent while the previous sandbox's harness runs.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Iterable, Iterator
    from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

POLL_S = 0.02
KILL_ROUNDS = 20  # bounds on every kill loop: a fork bomb must not keep us here forever
FREEZE_ROUNDS = 50
KILL_SETTLE_S = 0.5  # how long one SIGKILL round waits for the kernel to tear processes down
DRAIN_S = 2.0  # bound on reading what is left in the pipes after the tree is gone
READ_CHUNK = 64 * 1024
NAMESPACE_END_S = 10.0  # bound on the kernel's teardown of a PID namespace's processes
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# "Your timeout is now": the command ends as if its timeout had passed (timed out, not terminated). The
# owner sends it when a budget other than wall time runs out (limits.deadline_counts: agent).
EXPIRE_SIGNAL = signal.SIGUSR1
# Blocked by the server across a fork until the supervisor's own handlers are in place, so that a signal
# sent right after the fork is neither lost nor (SIGUSR1's default) fatal.
_HANDLED_SIGNALS = (*STOP_SIGNALS, EXPIRE_SIGNAL)


# ---------------------------------------------------------------------------------------------------------
# /proc helpers (also used by sandboxes.local from the worker side)


class ProcInfo:
    __slots__ = ("pgid", "pid", "ppid", "sid", "start_ticks", "state")

    def __init__(self, pid: int, ppid: int, pgid: int, sid: int, state: str, start_ticks: int) -> None:
        self.pid = pid
        self.ppid = ppid
        self.pgid = pgid
        self.sid = sid
        self.state = state
        self.start_ticks = start_ticks

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


def _libc_call(name: str, *args: object) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args[:1]} failed: {os.strerror(err)}")


def _prctl(option: int, value: int) -> None:
    _libc_call("prctl", option, value, 0, 0, 0)


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


# ---------------------------------------------------------------------------------------------------------
# Namespaces. A sandbox's PID namespace (a /proc of its own) is made once, by its server (``--serve ...
# --pid-namespace``): the server unshares it, forks the namespace's init (which mounts the fresh /proc in
# a mount namespace of its own and then only reaps orphans), and each supervisor it forks after that is
# born inside, then joins the init's mount namespace. The server stays outside, so the pids it reports
# are the host's, and an isolated command costs what a host one does:
#
#     server ─┬ init (pid 1: the namespace's /proc; reaps orphans; ends with the server)
#             └ supervisor ── command       (one per command, each inside the namespace)
#
# A loopback-only network namespace is per command: the supervisor forks an init into it, which runs the
# gateway forwarder and the command, and writes the command's raw wait status to a pipe.

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 0x40000
PR_CAPBSET_DROP = 24
CAP_SYS_ADMIN = 21


class PidNamespace:
    """A PID namespace for a server's supervisors, and the mount namespace holding its /proc."""

    def __init__(self) -> None:
        # Takes effect for our children only: the first is the namespace's pid 1, every later one is
        # born inside it too.
        _libc_call("unshare", CLONE_NEWPID)
        ready_r, ready_w = os.pipe()
        hold_r, self.hold = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(ready_r)
                os.close(self.hold)
                code = _pid_namespace_init(ready_w, hold_r)
            except BaseException as exc:  # a forked child must never return into the server
                os.write(2, f"sandbox pid namespace: {type(exc).__name__}: {exc}\n".encode(errors="replace"))
            finally:
                os._exit(code)
        os.close(ready_w)
        os.close(hold_r)
        self.init_pid = pid
        self.init_reaped = False
        try:
            ready = os.read(ready_r, 1)  # bounded: the init writes it, or dies and the pipe ends
        finally:
            os.close(ready_r)
        if ready != b"1":
            raise OSError(f"the PID namespace's init (pid {pid}) failed to start")
        self.mount_ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)

    def end(self, timeout: float) -> bool:
        """Close our end, which ends the init and with it the namespace; True once the init is reaped,
        which the kernel allows only when every other process of the namespace is gone."""
        os.close(self.hold)
        if self.init_reaped:
            return True
        exited = os.pidfd_open(self.init_pid)  # our unreaped child: its pid is still its own
        try:
            select.select([exited], [], [], timeout)
        finally:
            os.close(exited)
        pid, _status = os.waitpid(self.init_pid, os.WNOHANG)
        return pid == self.init_pid

    def enter(self) -> None:
        """In a supervisor just forked by the server: join the init's mount namespace (its /proc) and
        keep CAP_SYS_ADMIN from every program started after this, or root inside could unmount that /proc
        and see the host's again."""
        os.close(self.hold)  # the init ends with the server, not with us
        _libc_call("setns", self.mount_ns, CLONE_NEWNS)
        os.close(self.mount_ns)
        _prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN)


def _pid_namespace_init(ready_w: int, hold_r: int) -> int:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # the server's request pipe is not ours to hold open
    os.dup2(null, 1)
    os.close(null)
    # A mount namespace of its own (the server's /proc must stay the host's), private so that nothing
    # mounted here reaches the host.
    _libc_call("unshare", CLONE_NEWNS)
    _libc_call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    _libc_call("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    _prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN)
    # Orphans of supervisors that died are ours to reap; a handler, so SIGCHLD interrupts the read below.
    signal.signal(signal.SIGCHLD, lambda _s, _f: _reap_all())
    os.write(ready_w, b"1")
    os.close(ready_w)
    # Until the server closes its end, by exiting or dying. Our exit ends the namespace: the kernel kills
    # whatever is left in it.
    while os.read(hold_r, 64):
        pass
    return 0


def _reap_all() -> None:
    for _pid, _status in _exited_children():
        pass


def _start_network_init(
    p: dict[str, Any], env: dict[str, str] | None, stdin_fd: int, out_w: int, err_w: int
) -> tuple[_Forked, int]:
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setpgid(0, 0)  # its own group, which the command joins: killpg reaches both
            signal.set_wakeup_fd(-1)  # the supervisor's wake-up pipe is not ours to write
            os.close(status_r)
            for fd, target in ((stdin_fd, 0), (out_w, 1), (err_w, 2)):
                os.dup2(fd, target)
                os.close(fd)
            code = _network_init(p, env, status_w)
        except BaseException as exc:  # a forked child must never return into the supervisor
            os.write(2, f"sandbox isolation: {type(exc).__name__}: {exc}\n".encode(errors="replace"))
        finally:
            os._exit(code)
    os.close(status_w)
    return _Forked(pid), status_r


class _Forked:
    """The part of a Popen object the supervisor uses, for a child made by fork."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None


def _network_init(p: dict[str, Any], env: dict[str, str] | None, status_fd: int) -> int:
    _libc_call("unshare", CLONE_NEWNET)
    # Run by path with -I, our directory is not on sys.path; netns.py is our sibling.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import netns

    port, socket_path = p["network_forward"]
    netns.start_forwarder(int(port), str(socket_path))
    import subprocess  # netns has imported it already

    try:
        command = subprocess.Popen(
            p["argv"],
            cwd=p["cwd"],
            env=env,
            close_fds=True,
            preexec_fn=_address_space_limit(p.get("memory_limit_bytes")),
        )
    except OSError as exc:
        os.write(2, f"cannot run {p['argv'][0]!r}: {exc.strerror or exc}\n".encode(errors="replace"))
        os.write(status_fd, str((127 if isinstance(exc, FileNotFoundError) else 126) << 8).encode())
        return 0
    for fd in (0, 1, 2):  # the output pipes end when the command's side of them does
        os.dup2(os.open(os.devnull, os.O_RDWR), fd)
    reaped = False

    def pass_on(signum: int, _frame: object) -> None:
        if not reaped:  # once reaped, its pid may name another process
            try:
                os.kill(command.pid, signum)
            except ProcessLookupError:
                pass

    for sig in STOP_SIGNALS:
        signal.signal(sig, pass_on)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _pid, status = os.waitpid(command.pid, 0)
    reaped = True
    os.write(status_fd, str(status).encode())
    return 0


# Signals Python ignores at start-up, which a command must get at their defaults (as Popen's
# restore_signals does); handled ones revert by themselves at exec.
_RESTORED_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)


def _spawn(
    argv: list[str], cwd: str, env: dict[str, str] | None, stdin_fd: int, out_w: int, err_w: int
) -> int:
    """Start ``argv`` as Popen would (its environment's PATH searched, its own process group, the
    given stdio, no other descriptor: every one of ours is close-on-exec) with posix_spawn, which needs
    no `subprocess` import and no copy of our address space. Raises the OSError of a failed start."""
    os.chdir(cwd)
    if os.sep in argv[0]:
        candidates = [argv[0]]
    else:
        candidates = [os.path.join(d, argv[0]) for d in os.get_exec_path(env)]
    denied: OSError | None = None
    for path in candidates:
        # A check first: each spawn that fails costs a clone, where Popen tries every entry in one child.
        if not os.access(path, os.X_OK):
            if os.path.lexists(path):
                denied = denied or PermissionError(13, "Permission denied", path)
            continue
        try:
            return os.posix_spawn(
                path,
                argv,
                os.environ if env is None else env,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, stdin_fd, 0),
                    (os.POSIX_SPAWN_DUP2, out_w, 1),
                    (os.POSIX_SPAWN_DUP2, err_w, 2),
                ],
                setpgroup=0,  # its own group in our session, so killpg reaches it in one call
                setsigmask=(),
                setsigdef=_RESTORED_SIGNALS,
            )
        except (FileNotFoundError, NotADirectoryError):
            continue
        except PermissionError as exc:  # as execvpe: a later directory may still hold a runnable one
            denied = denied or exc
    raise denied or FileNotFoundError(2, "No such file or directory", argv[0])


def _popen_limited(
    p: dict[str, Any], env: dict[str, str] | None, stdin_fd: int, out_w: int, err_w: int
) -> subprocess.Popen[bytes]:
    """Start a command with an address-space limit, which only a hook between fork and exec can set;
    `subprocess` is imported for these alone."""
    import subprocess

    return subprocess.Popen(
        p["argv"],
        cwd=p["cwd"],
        env=env,
        stdin=stdin_fd,
        stdout=out_w,
        stderr=err_w,
        close_fds=True,
        process_group=0,
        preexec_fn=_address_space_limit(p["memory_limit_bytes"]),
    )


def _address_space_limit(memory: int | None) -> Callable[[], None] | None:
    """The hook that sets a command's RLIMIT_AS between fork and exec; None without a limit."""
    if not memory:
        return None
    limit = int(memory)

    def set_limit() -> None:  # runs in the forked child; we are single-threaded, so this is safe
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return set_limit


def _reported_status(status_pipe: int, init_status: int) -> int:
    """The command's wait status as its init reported it; the init's own if it died before reporting."""
    os.set_blocking(status_pipe, False)
    try:
        report = os.read(status_pipe, 64)
    except BlockingIOError:
        report = b""
    os.close(status_pipe)
    return int(report) if report.strip().isdigit() else init_status


def _signal_wakeup(sel: selectors.BaseSelector) -> tuple[int, int]:
    """A pipe that every signal writes a byte to, registered with ``sel``: a select() ends on a signal."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    sel.register(wake_r, selectors.EVENT_READ)
    return wake_r, wake_w


def _exited_children() -> Iterator[tuple[int, int]]:
    """(pid, wait status) of each child that has exited, collected without waiting."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def _drain_wakeup(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _install_signals(on_stop: Callable[[int, object], None]) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, on_stop)
    # A handler (not SIG_DFL) so that SIGCHLD writes to the wakeup fd and ends a select().
    signal.signal(signal.SIGCHLD, lambda _s, _f: None)


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
        self.pumps: dict[int, _Pump] = {}
        self.wake_r, self.wake_w = _signal_wakeup(self.sel)

    def install_signals(self) -> None:
        def on_stop(signum: int, _frame: object) -> None:
            if self.terminated_by is None:
                self.terminated_by = signum

        def on_expire(_signum: int, _frame: object) -> None:
            self.expired = True

        _install_signals(on_stop)
        signal.signal(EXPIRE_SIGNAL, on_expire)

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
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stdin_path = p.get("stdin_path") or os.devnull
        stdin_fd = os.open(stdin_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if p.get("network_forward"):
                self.child, self.status_pipe = _start_network_init(p, self.env, stdin_fd, out_w, err_w)
            elif p.get("memory_limit_bytes"):
                self.child = _popen_limited(p, self.env, stdin_fd, out_w, err_w)
            else:
                self.child = _Forked(_spawn(p["argv"], p["cwd"], self.env, stdin_fd, out_w, err_w))
        finally:
            for fd in (out_w, err_w, stdin_fd):
                os.close(fd)
            for fd, path in ((out_r, p["stdout_path"]), (err_r, p["stderr_path"])):
                self.pumps[fd] = _Pump(fd, path, int(p["output_cap_bytes"]), int(p["tail_bytes"]))
                self.sel.register(fd, selectors.EVENT_READ)

    def reap(self) -> None:
        for pid, status in _exited_children():
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
                _drain_wakeup(fd)
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
            if now >= timeout_at or self.expired:
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
            procs = snapshot()
            if any(procs[pid].pgid == child.pid for pid in self._tree(procs)):
                try:
                    os.killpg(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        return kill_processes(self.tree, grace_s=float(self.p["kill_grace_s"]), idle=self.idle)

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


def run(params: dict[str, Any], env: dict[str, str] | None = None) -> int:
    """Supervise one command to its end and write its result; ``env`` is the command's environment
    (None: our own). With ``before`` (argv, timeout_s, stdout_path, stderr_path and env of a step), that
    step runs to its end first and its result goes under "before": two commands for one supervisor."""
    result: dict[str, Any] = {}
    previous: Supervisor | None = None
    failure: BaseException | None = None
    before = params.get("before")
    if before:
        step = {**params, **before, "before": None}
        result["before"], previous, failure = _supervise(step, before.get("env", env))
    if failure is None:
        main, _sup, failure = _supervise(params, env, previous)
        result.update(main)
    else:
        result.update(result["before"])
    _write_json_atomic(params["result_path"], result)
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
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED_SIGNALS)  # blocked by the server across its fork
    if previous is not None:  # read after our handlers took over: no signal falls in between
        sup.terminated_by = previous.terminated_by
    reason, error = "error", None
    spawn_failure: OSError | None = None
    failure: BaseException | None = None
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
        failure = exc
    # Whatever happened above, nothing the command started may outlive us.
    clean = sup.kill_tree()
    sup.drain()
    sup.reap()
    sup.close()
    result = _spawn_failure(params, spawn_failure) if spawn_failure else sup.result(reason, clean, error)
    result["duration_s"] = time.monotonic() - started
    return result, sup, failure


# ---------------------------------------------------------------------------------------------------------
# Server mode: one process per sandbox that forks a supervisor per command. Starting an interpreter and
# importing this module costs tens of milliseconds, paid once per sandbox instead of once per command.
#
# Protocol, one JSON object per line. In (stdin): {"id": N, "params": {...}, "env": {...}}; params as for
# run() plus "log_path" (the forked supervisor's stderr). Out (stdout): {"id": N, "pid": P} once the
# supervisor is forked, {"id": N, "error": "..."} if it could not be, and {"id": N, "status": S} (a wait
# status) when it has ended. End of stdin: no more commands; the server exits when its supervisors have.
# The environment travels through the pipe, never through a file.

MAX_REQUEST_BYTES = 256 * 1024 * 1024  # argv may hold a whole prompt; a runaway writer must still stop


class _Server:
    def __init__(self, parent_pid: int, pid_namespace: PidNamespace | None) -> None:
        self.parent_pid = parent_pid
        self.me = os.getpid()
        self.pid_namespace = pid_namespace
        self.children: dict[int, int] = {}  # supervisor pid -> request id
        self.stop_signal: int | None = None
        self.stdin_open = True
        self.buf = bytearray()
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = _signal_wakeup(self.sel)
        os.set_blocking(0, False)
        self.sel.register(0, selectors.EVENT_READ)

    def install_signals(self) -> None:
        def on_stop(signum: int, _frame: object) -> None:
            if self.stop_signal is None:
                self.stop_signal = signum

        _install_signals(on_stop)
        # SIGTERM when the worker that started us dies; each supervisor is bound to us the same way.
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != self.parent_pid:
            self.stop_signal = signal.SIGTERM

    def reply(self, message: dict[str, Any]) -> None:
        # stdout is a blocking pipe that our worker always reads; a line is far below its capacity.
        data = memoryview((json.dumps(message) + "\n").encode())
        while data:
            data = data[os.write(1, data) :]

    def handle(self, line: bytes) -> None:
        try:
            req = json.loads(line)
            req_id = int(req["id"])
        except (ValueError, KeyError, TypeError):
            return  # not from our worker; nothing to answer
        # Stop signals wait until the forked supervisor has its own handlers (run() unblocks them), so
        # one sent right after the fork is not lost.
        signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED_SIGNALS)
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED_SIGNALS)
            self.reply({"id": req_id, "error": f"fork failed: {exc}"})
            return
        if pid == 0:
            self._child(req)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED_SIGNALS)
        self.children[pid] = req_id
        self.reply({"id": req_id, "pid": pid})

    def _child(self, req: dict[str, Any]) -> None:
        code = 1
        try:
            params = req["params"]
            # Inside a PID namespace our parent (outside it) shows as pid 0, and the init as 1 once we die.
            params["parent_pid"] = self.me
            if self.pid_namespace is not None:
                self.pid_namespace.enter()
                params["parent_pid"] = 0
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.sel.close()
            null = os.open(os.devnull, os.O_RDWR)
            log = os.open(params["log_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.dup2(log, 2)
            os.close(null)
            os.close(log)
            os.chdir(params["cwd"])
            code = run(params, req.get("env"))
        except BaseException as exc:  # a forked child must never return into the server
            with open(2, "w", closefd=False) as err:
                err.write(f"supervisor: {type(exc).__name__}: {exc}\n")
        finally:
            os._exit(code)

    def read_requests(self) -> None:
        try:
            chunk = os.read(0, READ_CHUNK)
        except BlockingIOError:
            return
        if not chunk:
            self.stdin_open = False
            self.sel.unregister(0)
            return
        self.buf += chunk
        while (end := self.buf.find(b"\n")) >= 0:
            line = bytes(self.buf[:end])
            del self.buf[: end + 1]
            self.handle(line)
        if len(self.buf) > MAX_REQUEST_BYTES:
            self.buf.clear()
            self.stdin_open = False  # our worker never writes this much: stop taking requests
            self.sel.unregister(0)

    def reap(self) -> None:
        for pid, status in _exited_children():
            req_id = self.children.pop(pid, None)
            if req_id is not None:
                self.reply({"id": req_id, "status": status})
            elif self.pid_namespace is not None and pid == self.pid_namespace.init_pid:
                self.pid_namespace.init_reaped = True  # its pid is free for reuse from here on

    def serve(self) -> int:
        # Bounded by the worker: it closes stdin when the sandbox stops, and each supervisor is bounded by
        # its command's timeout and the sandbox's TTL.
        while self.stdin_open or self.children:
            if self.stop_signal is not None:
                send(self.children, signal.SIGTERM)  # each ends its tree and records "terminated"
                return 0
            for key, _events in self.sel.select(1.0):
                if key.fd == self.wake_r:
                    _drain_wakeup(self.wake_r)
                elif key.fd == 0:
                    self.read_requests()
            self.reap()
        return 0


def main(argv: list[str]) -> int:
    if len(argv) in (3, 4) and argv[1] == "--serve":
        pid_namespace = PidNamespace() if argv[3:] == ["--pid-namespace"] else None
        server = _Server(int(argv[2]), pid_namespace)
        server.install_signals()
        code = server.serve()
        # Exit 0 only once the namespace is empty: the sandbox's stop() then needs no sweep of /proc.
        if pid_namespace is not None and not pid_namespace.end(NAMESPACE_END_S):
            code = 1
        os._exit(code)  # nothing to flush or finalize: the sandbox's stop() waits for this exit
    with open(argv[1], encoding="utf-8") as f:
        params = json.load(f)
    return run(params)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
