"""A root command out of reach of the in-sandbox agent beside it (a container sandbox whose task names no
user), and the agent out of the command's.

There the agent, its supervisor server and each command's supervisor run as root in the same container
as the commands. A command that could reach them could end its own exec as "sandbox lost" (a signal
to its supervisor or the agent, the agent's token and socket, the result files) and be masked rather
than graded: the policy choosing to be masked. So each such command's init, before it becomes the
command, takes:

- **a Landlock domain** scoped for signals: the command and all it starts can signal, trace or read
  (/proc/PID/root, cwd, fd, environ, mem) only processes of its own domain, never the agent's side,
  and cannot change its mounts;
- **a user namespace** mapping every id of the container's to itself, so the command is root for every
  file, user and group as before (its capabilities count only in its own namespaces);
- **seccomp filters**: no ``prlimit64`` on another process (the kernel lets a process set the limits of
  another of its uid: an agent left with 3 descriptors fails), nor ``pidfd_getfd`` or
  ``process_vm_writev`` (seccomp.py: among the command's own processes, the harness's connections to the
  gateway are the harness's);
- **a mount namespace** in which the agent's directories (its token and socket, results, logs) and the
  gateway's socket are covered, read-only and empty, and the OOM scores of every process there was
  before it (ours: the agent, its threads, the server, the supervisor) are read-only, which a root
  command could otherwise raise to have the OOM killer take one of ours. The domain keeps the command
  from undoing any of them.

No PID namespace: the container's /proc (no other can be mounted in a user namespace under the engine's
masked paths) would show the command pids that are not its own, and ``pkill`` and ``/proc/$$`` would
miss. The bounding set is the container's again (a new user namespace starts with a full one), less
CAP_SYS_ADMIN. Ports below 1024: the container's network namespace is not the command's user
namespace's, so binding them needs ``net.ipv4.ip_unprivileged_port_start=0`` (container.py sets it).

Standard library only, like supervisor.py and spawn.py, beside which it ships.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct

if __package__:
    from sandboxes import proctree, seccomp
else:  # beside supervisor.py, imported by spawn.py run by path
    import proctree
    import seccomp

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
CAP_SYS_ADMIN = 21
# Landlock's system calls (the same number on every architecture) and its signal scope (ABI 6).
LANDLOCK_CREATE_RULESET, LANDLOCK_RESTRICT_SELF = 444, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_SCOPE_SIGNAL = 2
LANDLOCK_SIGNAL_ABI = 6
MAP_TIMEOUT_S = 10.0  # bound on each step of the handshake with the parent that writes the maps
ERROR_BYTES = 400
_COVER = b"size=4k,mode=0555"


def identity_map(kind: str) -> bytes:
    """Our ``kind`` (uid | gid) map as a child namespace's: every id we have, mapped to itself."""
    with open(f"/proc/self/{kind}_map", encoding="ascii") as f:
        lines = [line.split() for line in f if line.strip()]
    return "".join(f"{first} {first} {count}\n" for first, _outside, count in lines).encode()


def bounding_set() -> int:
    """Our capability bounding set, as /proc says it."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("CapBnd:"):
                return int(line.split()[1], 16)
    raise OSError("no CapBnd in /proc/self/status")


class _Known:
    """The maps and the bounding set, read once by the process that imports us (a container's
    supervisor server, before it forks the supervisors that fork each init), never per command: in a
    freshly forked interpreter each line of Python copies pages (the bounding set's read cost ~1.3 ms
    there)."""

    def __init__(self) -> None:
        try:
            self.maps = {kind: identity_map(kind) for kind in ("uid", "gid")}
            self.bounding = bounding_set()
        except (OSError, ValueError):  # no /proc here: no command is nested (the agent's probe says so)
            self.maps, self.bounding = {}, 0


_KNOWN = _Known()


def map_child(pid: int, ready_r: int, go_w: int) -> None:
    """In the parent: once ``pid`` says it is in its new user namespace, give it our ids, then wait for
    it to say it is ready for its command. Raises OSError with the child's reason where it is not."""
    try:
        said = os.read(ready_r, ERROR_BYTES) if _readable(ready_r) else b""
        if said == b"u":
            for kind in ("uid", "gid"):
                with open(f"/proc/{pid}/{kind}_map", "wb") as f:
                    f.write(_KNOWN.maps[kind])
            os.write(go_w, b"m")
            said = os.read(ready_r, ERROR_BYTES) if _readable(ready_r) else b""
        if said != b"r":
            why = said[1:].decode(errors="replace") if said[:1] == b"e" else "no answer"
            raise OSError(f"the command's init ({pid}) could not nest it: {why}")
    finally:
        os.close(ready_r)
        os.close(go_w)


def enter(hide: Iterable[str], ready_w: int, go_r: int) -> None:
    """In the command's init, just before it becomes the command: the user namespace (the parent maps
    it, ``map_child``), the mount namespace and its covers, the bounding set, the Landlock domain. What
    fails is told to the parent (and raised): the command is then not run, and the fault is ours."""
    try:
        bounding = _KNOWN.bounding
        proctree.libc_call("unshare", CLONE_NEWUSER)
        os.write(ready_w, b"u")
        if not _readable(go_r) or os.read(go_r, 1) != b"m":
            raise OSError("the supervisor did not map the command's user namespace")
        proctree.libc_call("unshare", CLONE_NEWNS)
        for path in hide:
            cover(path)
        for how, path in ours():
            (seal if how == "seal" else cover)(path)
        for cap in range(64):
            if cap == CAP_SYS_ADMIN or not (bounding >> cap) & 1:
                try:
                    proctree.prctl(proctree.PR_CAPBSET_DROP, cap)
                except OSError:  # past the kernel's last capability
                    break
        # Our filter, while CAP_SYS_ADMIN (in its own namespace) lets it in without no_new_privs, which
        # would keep a root command's set-uid tools from working: no other process's limits, descriptors
        # or memory (the harness's connections are its own, netns.py).
        seccomp.install_nested()
        restrict_signals()
    except BaseException as exc:
        os.write(ready_w, b"e" + f"{type(exc).__name__}: {exc}".encode(errors="replace")[:ERROR_BYTES])
        raise
    finally:
        os.close(go_r)
    os.write(ready_w, b"r")
    os.close(ready_w)


def ours() -> list[tuple[str, str]]:
    """What of every process in sight but this one (the command to be) a root command could otherwise
    change, each to "seal" (read-only, still read) or "cover": its OOM scores, and its threads, whose
    /proc/TID (unlisted, there by name) and task/TID hold their process's score too. Its /proc/PID
    stays, so that ``ps`` and a walk up a command's ancestors see them as before."""
    found, me = [], str(os.getpid())
    for name in os.listdir("/proc"):
        if name.isdigit() and name != me:
            found += [("seal", f"/proc/{name}/oom_score_adj"), ("seal", f"/proc/{name}/oom_adj")]
            try:
                tids = [tid for tid in os.listdir(f"/proc/{name}/task") if tid != name]
            except OSError:  # ended since
                continue
            found += [("cover", f"/proc/{name}/task")] + [("cover", f"/proc/{tid}") for tid in tids]
    return found


def cover(path: str) -> None:
    """An empty read-only directory over ``path``, or /dev/null over a file or socket; nothing where
    nothing is (or a process of ours ended since /proc was listed)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            flags = ctypes.c_ulong(MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
            proctree.libc_call("mount", b"tmpfs", path.encode(), b"tmpfs", flags, _COVER)
        elif os.path.lexists(path):
            proctree.libc_call("mount", b"/dev/null", path.encode(), None, ctypes.c_ulong(MS_BIND), None)
    except OSError as exc:
        if os.path.lexists(path):
            raise OSError(exc.errno, f"cannot cover {path}: {exc.strerror or exc}") from None


def seal(path: str) -> None:
    """``path`` bound read-only over itself: read as before, written by no one (EROFS)."""
    try:
        proctree.libc_call("mount", path.encode(), path.encode(), None, ctypes.c_ulong(MS_BIND), None)
        # The flags locked on /proc (the engine mounts it so) must be kept, or the remount is refused.
        flags = ctypes.c_ulong(MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        proctree.libc_call("mount", None, path.encode(), None, flags, None)
    except OSError as exc:
        if os.path.lexists(path):
            raise OSError(exc.errno, f"cannot seal {path}: {exc.strerror or exc}") from None


def restrict_signals() -> None:
    """This thread, and all it starts, into a Landlock domain of its own that scopes signals (and, as
    every domain does, tracing and mount changes) to itself. No file access is restricted by it."""
    libc = proctree.libc()
    attr = struct.pack("QQQ", 0, 0, LANDLOCK_SCOPE_SIGNAL)  # handled fs, handled net, scoped
    fd = libc.syscall(LANDLOCK_CREATE_RULESET, attr, len(attr), 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        if libc.syscall(LANDLOCK_RESTRICT_SELF, fd, 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def probe() -> str | None:
    """Why commands cannot be nested here (None: they can): Landlock's signal scope, then a child tries
    the namespaces, a cover and the domain, and says what failed on a pipe."""
    libc = proctree.libc()
    abi = libc.syscall(LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    if abi < LANDLOCK_SIGNAL_ABI:
        found = f"ABI {abi}" if abi > 0 else os.strerror(ctypes.get_errno())
        return f"root commands nested (no Landlock signal scope: {found}; Linux >= 6.12 has it)"
    why_r, why_w = os.pipe()
    pid = os.fork()
    if pid == 0:

        def body() -> int:
            os.close(why_r)
            try:
                proctree.libc_call("unshare", CLONE_NEWUSER | CLONE_NEWNS)
                cover(f"/proc/{os.getpid()}")
                restrict_signals()
            except OSError as exc:
                os.write(why_w, str(exc).encode(errors="replace")[:ERROR_BYTES])
                return 1
            return 0

        proctree.end_child("nest probe", body)
    os.close(why_w)
    try:
        ended = _readable(why_r)  # the child's end closes it
        why = os.read(why_r, ERROR_BYTES).decode(errors="replace") if ended else "no answer in time"
    finally:
        os.close(why_r)
    if not ended:
        os.kill(pid, 9)
    status = os.waitpid(pid, 0)[1]
    return None if status == 0 else f"root commands nested ({why or status})"[:ERROR_BYTES]


def _readable(fd: int) -> bool:
    poller = select.poll()  # not select(): an agent's descriptors may pass FD_SETSIZE
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(MAP_TIMEOUT_S * 1000)))
