"""A fork server for supervisor servers: one pre-imported interpreter per provider that forks each
sandbox's server, instead of a fresh ``python -I -S supervisor_server.py`` per sandbox.

An interpreter's start-up and the server's imports are ~30 ms of CPU a sandbox; a fork of this small
process is well under one. The worker (sandboxes/exec_server.py) starts it as

    python3 -I -S zygote.py WORKER_PID CONTROL_FD

with the environment a server gets (only the sandbox marker variable, here a placeholder of a token's
length), from /, every other descriptor closed: nothing of the worker's (its key, its sockets, another
sandbox's pipes) is ever in this process. Each request is one message on CONTROL_FD (a SOCK_SEQPACKET
socket): ``{"marker": TOKEN, "pid_namespace": bool, "network": [PORT, SOCKET] | null, "views": bool,
"network_handed_on": bool}`` (views: every command of the sandbox has a filesystem view:
supervisor_server.serve; network_handed_on: no command of it runs as root, see ``_network_namespace``)
with two descriptors, the read end of the new server's request pipe and the write end of its answer
pipe. The child gets those as its stdin and stdout, a pidfd of the worker as fd 3, the base mount
namespace (see ``_base_mounts``) as fd 4 where there is one, the network namespace to join as fd 5 where
it is given one, and nothing else; writes its
sandbox's marker over the placeholder in its own environment block, so that /proc/PID/environ shows it
as it would for a server the worker had started; and runs ``supervisor_server.serve``. A fork that fails
is answered on the answer pipe as ``{"error": ...}``. Requests that wait together are read together and
their servers forked one after another (``_Zygote.receive``): each page this process writes between two
forks is copied, shared as it is with the children alive.

The zygote exits when the worker does, or when the worker closes the control socket and the servers it
forked have exited; a server it forked outlives it (reparented), bound to the worker by its pidfd.
Standard library only, like supervisor_server.py.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import selectors
import signal
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run by path with -I
# fsview, netns, pidlimit, seccomp: what supervisor_server.main imports for a command's init, here once.
import fsview
import namespaces
import netns
import pidlimit  # noqa: F401
import proctree
import seccomp  # noqa: F401
import spawn
import supervisor
import supervisor_server

MARKER_VAR = supervisor_server.MARKER_VAR

WORKER_FD = 3  # where a forked server finds the worker's pidfd
BASE_FD = 4  # where it finds the base mount namespace, if there is one
NET_FD = 5  # where it finds the network namespace to join, if it is given one
# Network namespaces kept for later sandboxes (``_network_namespace``): as many as ever end at once
# between two starts, at most this many.
MAX_SPARE_NETWORKS = 64
CLONE_NEWNS = 0x00020000
MAX_REQUEST_BYTES = 64 * 1024
MAX_BATCH = 64  # requests read before their forks: a burst's, a few at a time, the rest in later rounds
_ENV_START_FIELD = 50  # /proc/PID/stat: the address of the environment block (proc(5))


def _base_mounts() -> int | None:
    """A mount namespace holding one empty tmpfs (fsview.make_base), made once for all our sandboxes: a
    command's view is unshared from it rather than from the host's (spawn._init), which spares each
    command a copy and a tear-down of every host mount. None where it cannot be made (not root, no mount
    API): the views are then made from the host's, as before."""
    if os.geteuid() != 0:
        return None
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:

        def base() -> int:
            os.close(ready_r)
            os.close(hold_w)
            proctree.libc_call("unshare", CLONE_NEWNS)
            fsview.make_base()
            os.write(ready_w, b"1")
            os.read(hold_r, 1)  # until our parent has opened our namespace (or died)
            return 0

        proctree.end_child("zygote: no base mount namespace", base)
    os.close(ready_w)
    os.close(hold_r)
    try:
        made = os.read(ready_r, 1) == b"1"  # bounded: the child writes it or dies
        return os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC) if made else None
    except OSError:
        return None
    finally:
        os.close(ready_r)
        os.close(hold_w)
        os.waitpid(pid, 0)


def _marker_address() -> int:
    """Where the marker's value lies in this process's environment block, which /proc/PID/environ shows
    (and a fork inherits at the same address). Checked by reading it back through /proc/self/mem."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    env_start = int(fields[_ENV_START_FIELD - 3])
    with open("/proc/self/environ", "rb") as f:
        block = f.read()
    entry = f"{MARKER_VAR}=".encode()
    at = 0 if block.startswith(entry) else block.find(b"\0" + entry) + 1
    if at == 0 and not block.startswith(entry):
        raise OSError(f"no {MARKER_VAR} in the zygote's environment")
    address = env_start + at + len(entry)
    expected = os.environ[MARKER_VAR].encode()
    fd = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
    try:
        if os.pread(fd, len(expected), address) != expected:
            raise OSError("the zygote's environment block is not where /proc says")
    finally:
        os.close(fd)
    return address


class _Request:
    """One server to fork: the request's fields, its two pipes, and the network namespace it joins."""

    __slots__ = (
        "as_init", "network", "network_handed_on", "network_ns", "out", "pid_namespace", "stdin", "token",
        "views",
    )  # fmt: skip

    def __init__(
        self,
        token: str,
        pid_namespace: bool,
        network: tuple[int, str] | None,
        stdin: int,
        out: int,
        views: bool,
        network_handed_on: bool,
        as_init: bool,
    ) -> None:
        self.token, self.pid_namespace, self.network = token, pid_namespace, network
        self.stdin, self.out, self.views = stdin, out, views
        self.network_handed_on, self.as_init = network_handed_on, as_init
        self.network_ns: int | None = None


class _Zygote:
    def __init__(self, worker_pid: int, control_fd: int) -> None:
        self.worker = os.pidfd_open(worker_pid)
        if os.getppid() != worker_pid:
            raise SystemExit(0)  # the worker died before its pidfd was open: nobody to serve
        self.base = _base_mounts()
        # Our own PID namespace, to return our children's to after forking a server into a new one.
        self.pid_ns = -1 if self.base is None else os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.placeholder = os.environ[MARKER_VAR]
        self.marker_at = _marker_address()
        self.control = socket.socket(fileno=control_fd)
        self.control.setblocking(False)
        # Each server we forked, and the network namespace it joined (ours to hand on once it is empty).
        self.children: dict[int, int | None] = {}
        # Network namespaces of ended sandboxes, loopback up and nothing in them: a namespace made, its
        # loopback brought up and torn down again cost ~1.8 ms of the machine's CPU (half of it in the
        # kernel's workers, after the sandbox), where joining one costs microseconds.
        self.spare_networks: list[int] = []
        self.own_network = (
            -1 if self.base is None else os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        )
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = supervisor.signal_wakeup(self.sel)
        proctree.set_handler(signal.SIGCHLD, lambda _s, _f: None)  # a handler, so that it wakes the select
        self.sel.register(self.control, selectors.EVENT_READ)
        self.sel.register(self.worker, selectors.EVENT_READ)
        self.open = True

    def serve(self) -> int:
        # Bounded by the worker: its death ends us, and its control socket's end stops the forks.
        while self.open or self.children:
            for key, _events in self.sel.select():
                if key.fd == self.wake_r:
                    supervisor.drain_wakeup(self.wake_r)
                elif key.fd == self.worker:
                    return 0  # our servers see the same pidfd and end their sandboxes
                else:
                    self.receive()
            self.reap()
        return 0

    def reap(self) -> None:
        for pid, status in proctree.exited_children():
            network = self.children.pop(pid, None)
            if network is None:
                continue
            # Exit 0: the server's PID namespace was empty (supervisor_server.serve), so nothing of the
            # sandbox holds a socket in its network namespace any more. Any other end: not handed on.
            if status == 0 and self.open and len(self.spare_networks) < MAX_SPARE_NETWORKS:
                self.spare_networks.append(network)
            else:
                os.close(network)

    def _network_namespace(self) -> int | None:
        """A network namespace for a new sandbox: an ended sandbox's, else a new one with its loopback up
        (None where none can be made: the server then makes its own)."""
        if self.spare_networks:
            return self.spare_networks.pop()
        try:
            proctree.libc_call("unshare", namespaces.CLONE_NEWNET)
        except OSError:
            return None
        try:
            netns.loopback_up()
            return os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        finally:
            try:
                proctree.libc_call("setns", self.own_network, namespaces.CLONE_NEWNET)
            except OSError as exc:  # every later sandbox would start in this namespace: end instead
                os.write(
                    2, f"zygote: cannot return to its network namespace: {exc}\n".encode(errors="replace")
                )
                os._exit(1)

    def receive(self) -> None:
        """Every request waiting (up to ``MAX_BATCH``), each forked in turn: in a burst of starts the
        forks follow each other with as little as can be between them, since every page we write
        between two forks is copied (each is shared with the children alive)."""
        batch: list[_Request] = []
        try:
            while len(batch) < MAX_BATCH and self.open:
                if (request := self._next_request()) is not None:
                    batch.append(request)
        except BlockingIOError:
            pass
        if not batch:
            return
        gc.freeze()  # no collection in a child walks (and so copies) the pages of what we hold
        self.reap()  # a server that ended before these requests hands its network namespace on to one
        for request in batch:
            if request.as_init and request.network and request.network_handed_on:
                request.network_ns = self._network_namespace()
        try:
            for request in batch:
                self.fork(request)
        finally:
            for request in batch:
                os.close(request.stdin)
                os.close(request.out)

    def _next_request(self) -> _Request | None:
        """The next request on the control socket, parsed; None for one that is bad (said on stderr, its
        descriptors closed) or for the socket's end. Raises BlockingIOError when none waits."""
        data, ancdata, _flags, _addr = self.control.recvmsg(MAX_REQUEST_BYTES, socket.CMSG_SPACE(8 * 4))
        fds: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                fds += [int.from_bytes(payload[i : i + 4], sys.byteorder) for i in range(0, usable, 4)]
        if not data and not fds:
            self.open = False  # the worker closed its end: no more sandboxes
            self.sel.unregister(self.control)
            self.control.close()
            return None
        try:
            req = json.loads(data)
            token = str(req["marker"])
            if len(fds) != 2 or not supervisor_server.is_marker(token, self.placeholder):
                raise ValueError("a request takes a marker of the placeholder's length and two descriptors")
            pid_ns, views = bool(req.get("pid_namespace")), bool(req.get("views"))
            network = req.get("network")
            forward = (int(network[0]), str(network[1])) if network else None
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            os.write(2, f"zygote: bad request: {str(exc)[:200]}\n".encode())
            for fd in fds:
                os.close(fd)
            return None
        # Where every view is made from the base, the server is its PID namespace's init itself
        # (namespaces.ServerInit): a fork and a long-lived process less a sandbox.
        as_init = pid_ns and views and self.base is not None
        handed_on = bool(req.get("network_handed_on"))
        return _Request(token, pid_ns, forward, fds[0], fds[1], views, handed_on, as_init)

    def fork(self, request: _Request) -> None:
        """Fork the server of ``request``; a fork that fails is told on its answer pipe."""
        pid = -1
        try:
            if request.as_init:
                proctree.libc_call("unshare", namespaces.CLONE_NEWPID)
            pid = os.fork()
        except OSError as exc:
            supervisor_server.write_line(request.out, {"error": f"fork failed: {exc}"})
        if pid and request.as_init:  # our next child is born in our own namespace again
            proctree.libc_call("setns", self.pid_ns, namespaces.CLONE_NEWPID)
        if pid > 0:
            self.children[pid] = request.network_ns
        elif pid < 0 and request.network_ns is not None:
            self.spare_networks.append(request.network_ns)  # never joined
        if pid:
            return

        def server() -> int:
            self._become_server(request)
            base = BASE_FD if self.base is not None else None
            joined = NET_FD if request.network_ns is not None else None
            return supervisor_server.serve(
                WORKER_FD,
                request.pid_namespace,
                request.network,
                base,
                request.views,
                request.as_init,
                joined,
                self.marker_at,
            )

        proctree.end_child("zygote child", server)

    def _become_server(self, request: _Request) -> None:
        """In the forked child: the sandbox's marker, its own session, and only its own descriptors."""
        network = request.network_ns
        if network is not None:  # out of the way of the descriptors moved into place below
            network = fcntl.fcntl(network, fcntl.F_DUPFD_CLOEXEC, NET_FD + 1)
        proctree.name_process(b"rollout-server")
        signal.set_wakeup_fd(-1)
        proctree.set_handler(signal.SIGCHLD, signal.SIG_DFL)
        self.sel.close()
        if self.open:
            self.control.close()
        os.setsid()
        os.dup2(request.stdin, 0)
        os.dup2(request.out, 1)
        if self.worker != WORKER_FD:  # dup3 refuses a descriptor onto itself
            os.dup2(self.worker, WORKER_FD, inheritable=False)
        if self.base is not None and self.base != BASE_FD:
            os.dup2(self.base, BASE_FD, inheritable=False)
        if network is not None:
            os.dup2(network, NET_FD, inheritable=False)
        # Other requests' pipes, our own, the wake-up, the spare network namespaces.
        os.closerange(
            (WORKER_FD if self.base is None else NET_FD if network is not None else BASE_FD) + 1, spawn.MAX_FD
        )
        supervisor_server.set_marker(self.marker_at, request.token)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not (argv[1].isdigit() and argv[2].isdigit()):
        print("usage: zygote.py WORKER_PID CONTROL_FD", file=sys.stderr)
        return 2
    proctree.name_process(b"rollout-zygote")
    spawn.new_session_keyring()  # nothing of the worker's keyring for the servers we fork
    zygote = _Zygote(int(argv[1]), int(argv[2]))
    return zygote.serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
