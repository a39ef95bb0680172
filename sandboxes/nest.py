"""A command's own user, PID and mount namespace, for commands that run as root beside the in-sandbox
agent (a container sandbox whose task names no user).

There the agent, its supervisor server and each command's supervisor run as root in the same container
as the commands, and a command that could reach them could end its own exec as "sandbox lost" (a
signal to its supervisor or the agent, the agent's token and socket, the result files) and be masked
rather than graded: the policy choosing to be masked. So each such command starts nested::

    supervisor ── init (container's namespaces) ── pid 1 (the command's namespaces) ── command

- **user**: a user namespace mapping every id of the container's to itself, so the command is root for
  every file, user and group as before, while its capabilities count only in its own namespaces: no
  ptrace-mode access to a process outside (its /proc/PID/root, cwd, fd, environ, mem), whatever the
  uid, and no signal to what it cannot name;
- **pids**: a PID namespace of its own, so it can name no process of ours; its pid 1 reaps, passes
  signals on, and, by ending, ends everything the command left behind in it;
- **mounts**: a mount namespace in which the agent's directories (its token and socket, results, logs)
  and the gateway's socket are covered, read-only and empty, and /proc/PID of every process there was
  before the command (ours: the agent, its threads, the server, the supervisor), whose oom_score_adj a
  root command could otherwise raise; the command holds no CAP_SYS_ADMIN to undo them, and a user
  namespace it makes sees them locked.

Its capability bounding set is the container's again (a new user namespace starts with a full one),
less CAP_SYS_ADMIN. Ports below 1024: the container's network namespace is not the command's user
namespace's, so binding them needs ``net.ipv4.ip_unprivileged_port_start=0`` (container.py sets it).

Standard library only, like supervisor.py and spawn.py, beside which it ships.
"""

from __future__ import annotations

import ctypes
import os
import select

if __package__:
    from sandboxes import proctree
else:  # beside supervisor.py, imported by spawn.py run by path
    import proctree

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x10000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND = 1, 2, 4, 8, 4096
CAP_SYS_ADMIN = 21
MAP_TIMEOUT_S = 10.0  # bound on the handshake with the parent that writes the maps
_COVER = "size=4k,mode=0555"


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


def map_child(pid: int, ready_r: int, go_w: int) -> None:
    """In the parent: once ``pid`` says it is in its new user namespace, give it our ids and tell it."""
    try:
        if not _readable(ready_r) or os.read(ready_r, 1) != b"u":
            raise OSError(f"the command's init ({pid}) did not enter its user namespace")
        for kind in ("uid", "gid"):
            proctree.write_small(f"/proc/{pid}/{kind}_map", identity_map(kind).decode())
        os.write(go_w, b"m")
    finally:
        os.close(ready_r)
        os.close(go_w)


def enter(hide: Iterable[str], ready_w: int, go_r: int) -> None:
    """In the command's init, before it forks the namespaces' pid 1: the user namespace (the parent maps
    it: ``map_child``), then the PID and mount namespaces, the covers, and the bounding set."""
    bounding = bounding_set()
    proctree.libc_call("unshare", CLONE_NEWUSER)
    os.write(ready_w, b"u")
    os.close(ready_w)
    if not _readable(go_r) or os.read(go_r, 1) != b"m":
        raise OSError("the supervisor did not map the command's user namespace")
    os.close(go_r)
    proctree.libc_call("unshare", CLONE_NEWNS | CLONE_NEWPID)
    for path in [*hide, *ours()]:
        cover(path)
    for cap in range(64):
        if cap == CAP_SYS_ADMIN or not (bounding >> cap) & 1:
            try:
                proctree.prctl(proctree.PR_CAPBSET_DROP, cap)
            except OSError:  # past the kernel's last capability
                break


def ours() -> list[str]:
    """/proc/PID of every process and thread in sight: the command's own all come after."""
    paths = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            paths.append(f"/proc/{name}")
            try:  # a thread's /proc/TID is there by name, unlisted: its oom_score_adj is its process's
                paths += [f"/proc/{tid}" for tid in os.listdir(f"/proc/{name}/task") if tid != name]
            except OSError:  # ended since
                pass
    return paths


def cover(path: str) -> None:
    """An empty read-only directory over ``path``, or /dev/null over a file or socket; nothing where
    nothing is (or a process of ours ended since /proc was listed)."""
    try:
        is_dir = os.path.isdir(path) and not os.path.islink(path)
        if is_dir:
            flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
            proctree.libc_call(
                "mount", b"tmpfs", path.encode(), b"tmpfs", ctypes.c_ulong(flags), _COVER.encode()
            )
        elif os.path.lexists(path):
            proctree.libc_call("mount", b"/dev/null", path.encode(), None, ctypes.c_ulong(MS_BIND), None)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if not (path.startswith("/proc/") and not os.path.exists(path)):
            raise OSError(exc.errno, f"cannot cover {path}: {exc.strerror}") from None


def probe() -> str | None:
    """Why commands cannot be nested here (None: they can): a child tries the namespaces and a cover,
    and says what failed on a pipe."""
    why_r, why_w = os.pipe()
    pid = os.fork()
    if pid == 0:

        def body() -> int:
            os.close(why_r)
            try:
                proctree.libc_call("unshare", CLONE_NEWUSER)
                proctree.libc_call("unshare", CLONE_NEWNS | CLONE_NEWPID)
                cover(f"/proc/{os.getpid()}")
            except OSError as exc:
                os.write(why_w, str(exc).encode(errors="replace")[:300])
                return 1
            return 0

        proctree.end_child("nest probe", body)
    os.close(why_w)
    try:
        ended = _readable(why_r)  # the child's end closes it
        why = os.read(why_r, 300).decode(errors="replace") if ended else "no answer in time"
    finally:
        os.close(why_r)
    if not ended:
        os.kill(pid, 9)
    status = os.waitpid(pid, 0)[1]
    if status == 0:
        return None
    return f"no user, PID and mount namespace of its own for a command ({why or status})"


def _readable(fd: int) -> bool:
    poller = select.poll()  # not select(): an agent's descriptors may pass FD_SETSIZE
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(MAP_TIMEOUT_S * 1000)))
