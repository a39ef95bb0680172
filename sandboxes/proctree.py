"""A sandbox's processes as /proc shows them, and how to end them: a process's record, the tree under
a process, signals to many at once, a tree killed in bounded rounds, children reaped; and the libc calls
(prctl among them) a process makes on itself.

Shared by the per-command supervisor, its server and the in-sandbox agent, which run as standard-library
scripts (so this module is standard library only too, and ships beside them), and by the local sandbox
on the worker's side.
"""

from __future__ import annotations

import _signal
import ctypes
import os
import select
import signal
import time

# No `typing` at start-up: the supervisor's server imports this module (see supervisor_server.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from typing import NoReturn

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
PR_CAPBSET_DROP = 24
CAP_SYS_ADMIN = 21

POLL_S = 0.02
KILL_ROUNDS = 20  # bounds on every kill loop: a fork bomb must not keep us here forever
FREEZE_ROUNDS = 50
KILL_SETTLE_S = 0.5  # how long one SIGKILL round waits for the kernel to tear processes down
# Where this process reads the processes it sees: the host's /proc, or its PID namespace's (``use_proc``).
PROC = "/proc"


def set_handler(signum: int, handler: Callable[[int, object], None] | int) -> None:
    """``signal.signal`` without its enum conversions, which a forked interpreter pays for on every call
    (a raised and caught ValueError whenever the handler it replaces is a function; ~30 us and a dozen
    pages copied a call, in processes forked a few times a sandbox)."""
    _signal.signal(signum, handler if callable(handler) else int(handler))  # SIG_DFL, SIG_IGN: ints


def read_small(path: str, limit: int = 1 << 22) -> str:
    """A small file of the kernel's (procfs, cgroupfs), at most ``limit`` bytes: with ``os.read`` rather
    than ``open``, whose text-file layers a forked interpreter pays for in pages copied (~35 of the ~100
    its cgroup checks took in a command's init). Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks: list[bytes] = []
        size = 0
        while size < limit and (chunk := os.read(fd, min(1 << 16, limit - size))):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def write_small(path: str, text: str, *, create: bool = False) -> None:
    """Write ``text`` to a file of the kernel's (a cgroup's limit, /proc/self/oom_score_adj), as
    ``read_small`` reads one; with ``create``, to a file made (or emptied) for it. Raises OSError."""
    data = text.encode()
    flags = os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT | os.O_TRUNC if create else 0)
    fd = os.open(path, flags, 0o666)
    try:
        while data:  # each write takes at least a byte, or raises
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


def block_signals(how: int, signums: Iterable[int]) -> None:
    """``signal.pthread_sigmask`` without converting the old mask it returns to enums."""
    _signal.pthread_sigmask(how, signums)


def use_proc(fd: int) -> None:
    """Read processes from the procfs mounted nowhere that ``fd`` holds (a PID namespace's, made by its
    init: namespaces.py), through this process's own descriptor link; the mount namespace stays the
    host's."""
    global PROC
    PROC = f"/proc/self/fd/{fd}"


class ProcInfo:
    __slots__ = ("name", "pgid", "pid", "ppid", "sid", "start_ticks", "state")

    def __init__(
        self, pid: int, ppid: int, pgid: int, sid: int, state: str, start_ticks: int, name: bytes = b""
    ) -> None:
        self.name = name  # as /proc/PID/comm shows it: at most 15 bytes, the process's own to change
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


def read_proc(pid: int, proc: str | None = None) -> ProcInfo | None:
    """``pid``'s record in ``proc`` (a procfs's path; this process's own, ``PROC``, when None)."""
    try:
        with open(f"{proc or PROC}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses; the fields after its last ")" are fixed.
    fields = data[data.rindex(b")") + 2 :].split()
    return ProcInfo(
        name=data[data.index(b"(") + 1 : data.rindex(b")")],
        pid=pid,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        state=fields[0].decode(),
        start_ticks=int(fields[19]),
    )


def snapshot() -> dict[int, ProcInfo]:
    procs: dict[int, ProcInfo] = {}
    for name in os.listdir(PROC):
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
        with open(f"{PROC}/{pid}/environ", "rb") as f:
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


def ended_within(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (not necessarily our child) has ended within ``timeout`` seconds, waited
    for on its pidfd: readable once it has ended, so at once rather than at the next look of a poll.
    True for a process already gone (or reaped). Raises AttributeError or OSError where there are no
    pidfds (Python < 3.9, Linux < 5.3)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        poller = select.poll()  # not select(): a busy agent's descriptors may pass FD_SETSIZE
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))
    finally:
        os.close(fd)


def exited_children() -> Iterator[tuple[int, int]]:
    """(pid, wait status) of each child that has exited, collected without waiting."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


# What a process standing in for its child (a namespace's init, a waiting parent) passes on to it.
PASSED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def wait_passing_signals(child: int, *, reap_all: bool, unblock: bool = False) -> int:
    """Wait for ``child``, passing ``PASSED_SIGNALS`` on to it, and return its wait status. ``reap_all``:
    as a PID namespace's init, also reap the orphans reparented here while waiting. ``unblock``: the
    caller held those signals blocked until their handlers are set (so none is lost in between)."""
    reaped = False

    def pass_on(signum: int, _frame: object) -> None:
        if not reaped:  # once reaped, its pid may name another process
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    for sig in PASSED_SIGNALS:
        set_handler(sig, pass_on)
    if unblock:
        block_signals(signal.SIG_UNBLOCK, PASSED_SIGNALS)
    while True:
        pid, status = os.waitpid(-1 if reap_all else child, 0)
        if pid == child:
            reaped = True
            return status


def shell_exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + N for a death by signal N."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


_libc: list[ctypes.CDLL] = []  # loaded once: a CDLL(None) per call cost ~50 us, ~10 calls a command


def libc() -> ctypes.CDLL:
    """The C library, errno kept, loaded once per process."""
    if not _libc:
        _libc.append(ctypes.CDLL(None, use_errno=True))
    return _libc[0]


def libc_call(name: str, *args: object) -> None:
    if getattr(libc(), name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args[:1]} failed: {os.strerror(err)}")


def prctl(option: int, value: int) -> None:
    libc_call("prctl", option, value, 0, 0, 0)


def name_process(name: bytes) -> None:
    """The name ps, top and perf show for this process (at most 15 bytes) until it execs: every process
    of a sandbox is a fork of one interpreter, and otherwise they all show as "python"."""
    libc_call("prctl", PR_SET_NAME, name, 0, 0, 0)


CHILD_ERROR_CHARS = 500  # a forked child's last words on stderr are one bounded line


def end_child(what: str, body: Callable[[], int]) -> NoReturn:
    """In a forked child: run ``body`` and exit with the code it returns. Whatever it raises (SystemExit
    and KeyboardInterrupt too) ends the child with 1 and one line on stderr, ``what: Error: message``:
    a fork of an interpreter must never return into its parent's code, where it would go on as a
    second copy of the parent."""
    code = 1
    try:
        code = body()
    except BaseException as exc:
        line = f"{what}: {type(exc).__name__}: {exc}"[:CHILD_ERROR_CHARS]
        os.write(2, f"{line}\n".encode(errors="replace"))
    finally:
        os._exit(code)
