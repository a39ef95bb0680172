"""A sandbox's PID namespace: a /proc of its own, made once, by the sandbox's supervisor server.

The server (``supervisor_server.py --serve ... --pid-namespace``) unshares it, forks the namespace's init
(which mounts the fresh /proc in a mount namespace of its own and then only reaps orphans), and each
supervisor it forks after that is born inside, then joins the init's mount namespace. The server stays
outside, so the pids it reports are the host's, and an isolated command costs what a host one does.

Where every command builds its own filesystem view from the fork server's base namespace (root's view,
spawn._init), nothing needs that mount namespace but the supervisors' own reading of /proc; it was a copy
of the host's whole mount table per sandbox (every mount of every sandbox in flight: ~11 ms of CPU to
copy and tear down at 2,800 mounts, twice a session). There the init makes a procfs of the namespace
mounted nowhere instead, and each supervisor reads it by descriptor (``proctree.use_proc``), staying in
the host's mount namespace as the server is::

    server ─┬ init (pid 1: the namespace's /proc; reaps orphans; ends with the server)
            └ supervisor ── command       (one per command, each inside the namespace)

Where the fork server (zygote.py) has a base mount namespace and every command a view, it forks the
server into a fresh PID namespace instead, and the server is its init itself (``ServerInit``); a command
alone in the sandbox needs no supervisor then (folded.py)::

    server (pid 1; the relay's threads) ┬ command                  (alone at its start)
                                        └ supervisor ── command    (started beside another)

With a network forward, the init also unshares the sandbox's loopback-only network namespace and runs the
gateway forwarder in it (netns.py), and each supervisor joins that namespace too. The filesystem view
is built once by the server, and joined by each command's init (supervisor_server.py, spawn.py); the
sandbox user is taken per command (spawn.py); the layers bubblewrap adds, and which layers a
sandbox gets, are in isolation.py. Standard library only: the server
imports this module.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time

if __package__:
    from sandboxes import fsview, netns, proctree
else:  # imported by the server run by path, with its directory on sys.path
    import fsview
    import netns
    import proctree

CLONE_FS = 0x00000200
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 0x40000
NAMESPACE_END_S = 10.0  # bound on the kernel's teardown of a PID namespace's processes


class PidNamespace:
    """A PID namespace for a server's supervisors, and the mount namespace holding its /proc."""

    parent_pid_inside = 0  # what a supervisor sees as its parent's pid: the server is outside

    def __init__(
        self, network: tuple[int, str] | None = None, close: tuple[int, ...] = (), *, own_mounts: bool = True
    ) -> None:
        """``network`` (port, gateway socket): the init also makes the sandbox's loopback-only network
        namespace and runs its gateway forwarder (netns.py), which every supervisor joins. ``close``:
        descriptors of the server's that the init must not hold. ``own_mounts``: the namespace's /proc
        is mounted in a mount namespace of the init's, which supervisors join; else it is mounted
        nowhere, and supervisors read it by descriptor (every command then makes its own view)."""
        # Takes effect for our children only: the first is the namespace's pid 1, every later one is
        # born inside it too.
        proctree.libc_call("unshare", CLONE_NEWPID)
        ready_r, ready_w = os.pipe()
        hold_r, self.hold = os.pipe()
        pid = os.fork()
        if pid == 0:

            def init() -> int:
                proctree.name_process(b"rollout-nsinit")
                for fd in (ready_r, self.hold, *close):
                    os.close(fd)
                return _pid_namespace_init(ready_w, hold_r, network, own_mounts)

            proctree.end_child("sandbox pid namespace", init)
        os.close(ready_w)
        os.close(hold_r)
        self.init_pid = pid
        self.init_reaped = False
        try:
            ready = os.read(ready_r, 32).split()  # bounded: the init writes it, or dies and the pipe ends
        finally:
            os.close(ready_r)
        if not ready or ready[0] != b"1" or len(ready) != (1 if own_mounts else 2):
            raise OSError(f"the PID namespace's init (pid {pid}) failed to start")
        self.mount_ns: int | None = None
        self.proc: int | None = None
        if own_mounts:
            self.mount_ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        else:  # the init's descriptor of its procfs, opened again here: the init holds the mount
            self.proc = os.open(f"/proc/{pid}/fd/{int(ready[1])}", os.O_PATH | os.O_CLOEXEC)
        self.net_ns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC) if network else None

    def end(self, timeout: float, wake: int | None = None) -> bool:
        """Close our end, which ends the init and with it the namespace; True once the init is reaped,
        which the kernel allows only when every other process of the namespace is gone: our own
        supervisors too, which are reaped here as they die (``wake``: readable on a SIGCHLD)."""
        os.close(self.hold)
        deadline = time.monotonic() + timeout
        exited = -1 if self.init_reaped else os.pidfd_open(self.init_pid)  # our unreaped child
        waits = [exited] if wake is None else [exited, wake]
        try:
            while not self.init_reaped:
                for pid, _status in proctree.exited_children():
                    self.init_reaped = self.init_reaped or pid == self.init_pid
                remaining = deadline - time.monotonic()
                if self.init_reaped or remaining <= 0:
                    break
                ready, _w, _x = select.select(waits, [], [], remaining)
                if wake is not None and wake in ready:
                    _drain(wake)
        finally:
            if exited >= 0:
                os.close(exited)
        return self.init_reaped

    def enter(self) -> None:
        """In a supervisor just forked by the server: join the init's mount namespace (its /proc) and
        keep CAP_SYS_ADMIN from every program started after this, or root inside could unmount that /proc
        and see the host's again."""
        os.close(self.hold)  # the init ends with the server, not with us
        if self.mount_ns is not None:
            proctree.libc_call("setns", self.mount_ns, CLONE_NEWNS)
            os.close(self.mount_ns)
        else:
            assert self.proc is not None
            proctree.use_proc(self.proc)
        if self.net_ns is not None:
            proctree.libc_call("setns", self.net_ns, CLONE_NEWNET)
            os.close(self.net_ns)
        proctree.prctl(proctree.PR_CAPBSET_DROP, proctree.CAP_SYS_ADMIN)


class ServerInit:
    """The PID namespace of a server that is its init itself: forked into a fresh one by the fork server
    (zygote.py), where every view is built from the base mount namespace and each supervisor reads the
    namespace's /proc by descriptor. One long-lived process a sandbox, not two: a forked interpreter
    costs ~2.5 ms of CPU at its start and its pages' share of the machine's memory scans while it
    waits. The server stays in the host's mount namespace (its /proc the host's: the pids it reports are
    the host's, ``host_pid``); commands cannot reach it, as they could not reach the init before: they
    run as another uid, or with no boundary claimed. With a network forward the server unshares the
    sandbox's network namespace and relays in a thread of its own (netns.py), on the host's
    filesystem root: its main thread then takes a filesystem context of its own, as ``setns`` into a
    view's mount namespace needs."""

    init_pid = None  # no child of the server's is the namespace's init
    mount_ns = None
    parent_pid_inside = 1  # what a supervisor sees as its parent's pid: the server's own

    def __init__(self, network: tuple[int, str] | None = None, network_ns: int | None = None) -> None:
        if os.getpid() != 1:
            raise OSError("the server is not the init of a PID namespace")
        self.proc = fsview.detached_proc()
        self.forwarder: netns.Forwarder | None = None
        if network is not None:
            if network_ns is not None:  # made by the fork server, or an ended sandbox's (zygote.py)
                proctree.libc_call("setns", network_ns, CLONE_NEWNET)
                os.close(network_ns)
            else:
                proctree.libc_call("unshare", CLONE_NEWNET)
            self.forwarder = netns.start_forwarder(*network, proc=f"/proc/self/fd/{self.proc}")
            proctree.libc_call("unshare", CLONE_FS)

    def enter(self) -> None:
        """In a supervisor just forked by the server: the namespace's /proc, and no CAP_SYS_ADMIN for
        any program started after this (it could not mount a procfs of the host's from here anyway)."""
        proctree.use_proc(self.proc)
        proctree.prctl(proctree.PR_CAPBSET_DROP, proctree.CAP_SYS_ADMIN)

    def held(self) -> tuple[int, ...]:
        """The descriptors a supervisor keeps of ours."""
        return (self.proc,)

    def end(self, timeout: float, wake: int) -> bool:
        """Kill whatever is left in the namespace (every process but us) and reap it; True once we have
        no child left (``wake``: readable on a SIGCHLD). Our exit would end them too; this way the
        server's last word can say so."""
        deadline = time.monotonic() + timeout
        # Every process of the namespace descends from us (an orphan is reparented to us, nothing joins
        # it from outside), so with no child of ours, living or a zombie, it holds nothing else. Worth the
        # look: the kernel's kill(-1) walks every process on the host (~6% of a server's CPU with a
        # thousand sandboxes in flight).
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return True
            remaining = deadline - time.monotonic()
            if pid == 0 and remaining <= 0:
                return False
            if pid == 0:
                select.select([wake], [], [], remaining)
                _drain(wake)

    def ready_for_next(self) -> bool:
        """Once ``end`` has emptied the namespace (a PID namespace keeps nothing of a process once it has
        been reaped): whether the gateway's relay is ready for the next sandbox we serve too
        (netns.Forwarder.forget)."""
        return self.forwarder is None or self.forwarder.forget()


def _drain(wake: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(wake, 512):
            pass


def host_pid(pid: int) -> int:
    """The host's pid of ``pid``, a process of our own PID namespace, from the pidfd's fdinfo in the
    host's /proc (its first NSpid field is in that procfs's namespace)."""
    fd = os.pidfd_open(pid)
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return int(line.split()[1])
    finally:
        os.close(fd)
    raise OSError(f"no NSpid for pid {pid}")


def _pid_namespace_init(
    ready_w: int, hold_r: int, network: tuple[int, str] | None, own_mounts: bool = True
) -> int:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # the server's request pipe is not ours to hold open
    os.dup2(null, 1)
    os.close(null)
    ready = b"1"
    proc = "/proc"  # the namespace's, mounted over the host's just below, or held by descriptor
    if own_mounts:
        # A mount namespace of its own (the server's /proc must stay the host's), private so that
        # nothing mounted here reaches the host.
        proctree.libc_call("unshare", CLONE_NEWNS)
        proctree.libc_call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
        proctree.libc_call("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    else:  # held open until we exit, which ends the namespace and every reader of its /proc
        held = fsview.detached_proc()
        ready += b" %d" % held
        proc = f"/proc/self/fd/{held}"
    if network is not None:  # one namespace and one forwarder for all the sandbox's commands
        proctree.libc_call("unshare", CLONE_NEWNET)
        netns.start_forwarder(*network, proc=proc)
    proctree.prctl(proctree.PR_CAPBSET_DROP, proctree.CAP_SYS_ADMIN)
    # Orphans of supervisors that died are ours to reap; a handler, so SIGCHLD interrupts the read below.
    proctree.set_handler(signal.SIGCHLD, lambda _s, _f: _reap_all())
    os.write(ready_w, ready)
    os.close(ready_w)
    # Until the server closes its end, by exiting or dying. Our exit ends the namespace: the kernel kills
    # whatever is left in it.
    while os.read(hold_r, 64):
        pass
    return 0


def _reap_all() -> None:
    for _pid, _status in proctree.exited_children():
        pass
