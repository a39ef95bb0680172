"""A sandbox's supervisor server: one process per sandbox that forks a supervisor for each command, or
supervises a command itself (folded.py) where it is the sandbox's PID-namespace init and the command the
only one running.

Starting an interpreter and importing the supervisor costs tens of milliseconds, paid once per sandbox
instead of once per command, and usually not even that: the provider's fork server (zygote.py) forks a
pre-imported one and calls ``serve``. Where there is no fork server, the local sandbox starts it (through
sandboxes/exec_server.py) as

    python3 -I -S supervisor_server.py --serve PARENT_PID [--pid-namespace [--network PORT SOCKET]]

With ``--pid-namespace``, every command of the sandbox runs in one PID namespace the server makes at its
start (namespaces.py); with ``--network PORT SOCKET`` also, in one loopback-only network namespace whose
127.0.0.1:PORT reaches the gateway's SOCKET. The server watches the worker through a pidfd: the worker's
death ends the sandbox (every supervisor is told to end its tree), whoever the server's parent is.

Protocol, one JSON object per line. In (stdin): {"id": N, "params": {...}, "env": {...}}; params as for
supervisor.run() plus "log_path" (the forked supervisor's stderr, appended to); or {"view": STEPS}
(no answer): build the sandbox's filesystem view now, before a command needs it; {"id": N, "signal": S}
(no answer): for a command the server supervises itself, what a signal S to its supervisor would say;
{"next": TOKEN}, to a reusable server: the sandbox has ended; once its commands are over, empty the
namespace and serve the next sandbox, whose marker is TOKEN (``_Server.hand_on``).
Out (stdout): {"ready": PID, "reusable": BOOL, "later_mounts": BOOL} first (reusable: its PID namespace's
init, forked by the fork server: it takes "next"; later_mounts: what is mounted on the host after its start
is where its commands' supervisors look); {"id": N, "pid": P} once a supervisor is forked (with "folded":
true, P is the command's init and the server supervises it), {"id": N, "error": "..."} if it could not be,
and {"id": N, "status": S} (a wait status) when it has ended, its result written; {"next": true} once the
namespace is empty after a "next" (the next sandbox's requests follow); {"exit": CODE} last (0: its PID
namespace ended with every process in it). End of stdin: no more commands; the server exits when its
supervisors, and the commands it supervises, have. The environment travels through the pipe, never
through a file.

Standard library only, like its siblings supervisor.py, proctree.py and namespaces.py.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import selectors
import signal
import sys
import time

if __package__:
    from sandboxes import folded, fsview, namespaces, native_init, proctree, spawn, supervisor
else:  # run by path: -I leaves our directory off sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import folded
    import fsview
    import namespaces
    import native_init
    import proctree
    import spawn
    import supervisor

# Neither `typing` nor `subprocess` at start-up (here or in the modules above): every sandbox starts a
# server, and those two imports were a third of its ~60 ms of CPU, spent while the previous sandbox's
# harness runs.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

CLONE_NEWIPC = 0x08000000
MARKER_VAR = "ROLLOUT_SANDBOX"  # sandboxes/environment.py's SANDBOX_MARKER_VAR
MAX_REQUEST_BYTES = 256 * 1024 * 1024  # argv may hold a whole prompt; a runaway writer must still stop


def is_marker(token: str, placeholder: str) -> bool:
    """Whether ``token`` may be written over ``placeholder``, a marker in our environment block: the
    block's length cannot change."""
    return len(token) == len(placeholder) and token.isalnum()


def set_marker(address: int, token: str) -> None:
    """Write ``token`` over the marker's value in our environment block, at ``address`` (where the fork
    server found it: zygote.py), which /proc/PID/environ shows, and into ``os.environ``."""
    mem = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
    try:
        os.pwrite(mem, token.encode(), address)
    finally:
        os.close(mem)
    os.environ[MARKER_VAR] = token


def write_line(fd: int, message: dict[str, Any]) -> None:
    """One answer line on ``fd``, a blocking pipe that our worker always reads; a line is far below its
    capacity."""
    data = memoryview((json.dumps(message) + "\n").encode())
    while data:
        data = data[os.write(fd, data) :]


class _Server:
    def __init__(
        self,
        worker: int,
        pid_namespace: namespaces.PidNamespace | None,
        base_mounts: int | None = None,
        marker_at: int | None = None,
    ) -> None:
        self.worker = worker  # a pidfd of the worker: readable once it has died
        self.marker_at = marker_at  # where our environment block holds the marker's value (``set_marker``)
        self.base_mounts = base_mounts  # a mount namespace to unshare views from (zygote.py), if any
        self.me = os.getpid()
        self.pid_namespace = pid_namespace
        # Held shared until our PID namespace is empty (at our exit, or before we serve another sandbox):
        # the sandbox's uid is not leased again while a process of it may be left (sandboxes/identity.py).
        self.busy: int | None = None
        self.uid_taken = False  # a command of the sandbox has run under its leased uid
        # The sandbox's filesystem view, built once (``_view``): its mount and IPC namespaces by the
        # view's steps, which every command of the sandbox joins. A view that could not be built is
        # built by each command's init instead, which reports why.
        self.views: dict[str, tuple[int, int] | None] = {}
        self.children: dict[int, int] = {}  # supervisor pid -> request id
        self.folded: dict[int, folded.FoldedExec] = {}  # by request id: the ones we supervise
        self.stop_signal: int | None = None
        self.stdin_open = True
        self.next_wanted: str | None = None  # {"next": TOKEN}: the sandbox has ended, TOKEN's follows
        self.buf = bytearray()
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = supervisor.signal_wakeup(self.sel)
        os.set_blocking(0, False)
        self.sel.register(0, selectors.EVENT_READ)
        # The worker's death is our SIGTERM; each supervisor is bound to us by its parent-death signal.
        self.sel.register(worker, selectors.EVENT_READ)

    @property
    def reusable(self) -> bool:
        """Whether we can serve another sandbox once ours has ended: its PID namespace's init, with a
        marker of the fork server's to write over."""
        return isinstance(self.pid_namespace, namespaces.ServerInit) and self.marker_at is not None

    def install_signals(self) -> None:
        def on_stop(signum: int, _frame: object) -> None:
            if self.stop_signal is None:
                self.stop_signal = signum

        supervisor.handle_stop_signals(on_stop)

    def reply(self, message: dict[str, Any]) -> None:
        write_line(1, message)

    def handle(self, line: bytes) -> None:
        try:
            req = json.loads(line)
            if isinstance(req, dict) and "next" in req and "id" not in req:
                token = req["next"]
                if self.reusable and isinstance(token, str) and is_marker(token, os.environ[MARKER_VAR]):
                    self.next_wanted = token
                return
            if isinstance(req, dict) and "view" in req and "id" not in req:  # {"view": STEPS}: no answer
                if self.pid_namespace is not None and isinstance(req["view"], list) and req["view"]:
                    self._view(req["view"])
                return
            req_id = int(req["id"])
            if "signal" in req:  # {"id": N, "signal": S}: for a request we supervise (folded.py)
                if (job := self.folded.get(req_id)) is not None:
                    job.signal(int(req["signal"]))
                return
        except (ValueError, KeyError, TypeError):
            return  # not from our worker; nothing to answer
        # Stop signals wait until the forked supervisor has its own handlers (run() unblocks them), so
        # one sent right after the fork is not lost.
        busy = req.get("params", {}).get("uid_busy") if isinstance(req.get("params"), dict) else None
        if busy and req["params"].get("user") and not self.uid_taken:
            # The sandbox's first command under its leased uid: the uid is not leased again until no
            # process of it is left here (uidpool.py).
            self.uid_taken = True
            self.busy = _hold_shared(str(busy))
        params = req.get("params")
        if isinstance(params, dict) and params.get("view") and self.pid_namespace is not None:
            shared = self._view(params["view"])
            if shared is not None:
                params["view_fds"] = list(shared)
        if (
            isinstance(self.pid_namespace, namespaces.ServerInit)
            and not self.children
            and not self.folded
            and isinstance(params, dict)
            and folded.can_fold(params)
        ):
            self._fold(req_id, params, req.get("env"))
            return
        proctree.block_signals(signal.SIG_BLOCK, supervisor.HANDLED_SIGNALS)
        try:
            pid = os.fork()
        except OSError as exc:
            proctree.block_signals(signal.SIG_UNBLOCK, supervisor.HANDLED_SIGNALS)
            self.reply({"id": req_id, "error": f"fork failed: {exc}"})
            return
        if pid == 0:
            self._child(req)
        proctree.block_signals(signal.SIG_UNBLOCK, supervisor.HANDLED_SIGNALS)
        self.children[pid] = req_id
        try:  # the worker signals it by the host's pid
            shown = _host_pid(pid)
        except OSError:  # gone already (its status follows): a pid the worker will not find
            shown = 0
        self.reply({"id": req_id, "pid": shown})

    def _fold(self, req_id: int, params: dict[str, Any], env: dict[str, str] | None) -> None:
        """Run the request with no supervisor of its own (folded.py): each command's init forked here."""
        namespace = self.pid_namespace
        assert isinstance(namespace, namespaces.ServerInit)
        proc = f"/proc/self/fd/{namespace.proc}"
        job = folded.FoldedExec(params, env, proc, self.children.keys, namespace.enter)
        try:
            done = job.start()
        except OSError as exc:  # its result could not be written
            self.reply({"id": req_id, "error": f"cannot start a command: {exc}"})
            return
        self.reply({"id": req_id, "pid": _host_pid(job.pid) if job.pid else 0, "folded": True})
        if done:
            self.reply({"id": req_id, "status": 0})
            return
        self.folded[req_id] = job
        self._watch(job)

    def _watch(self, job: folded.FoldedExec) -> None:
        if job.current is not None:
            for fd in job.current.open_fds:
                self.sel.register(fd, selectors.EVENT_READ, job.current)

    def _settle(self) -> None:
        """Move on each request we supervise whose command's run is over, and say when one is done."""
        now = time.monotonic()
        for req_id, job in list(self.folded.items()):
            running = job.current
            if running is not None and running.reason(now) is None:
                continue
            if running is not None:
                for fd in running.open_fds:
                    self.sel.unregister(fd)
            status = 0
            try:
                done = job.advance(now, self.wake_r, self.reap)
            except Exception as exc:  # no result written: the worker says the sandbox was lost, and why
                os.write(2, f"supervisor server: command {req_id}: {exc}\n"[:500].encode())
                done, status = True, 1 << 8
            if done:
                del self.folded[req_id]
                self.reply({"id": req_id, "status": status})
            else:
                self._watch(job)

    def _child(self, req: dict[str, Any]) -> NoReturn:
        def child() -> int:
            proctree.name_process(b"rollout-sup")
            params = req["params"]
            # Inside a PID namespace our parent shows as pid 0 (outside it), or as 1 (a server that is the
            # namespace's init itself), and the init as 1 once the server dies.
            params["parent_pid"] = self.me
            per_command_view = params.get("view") and not params.get("view_fds")
            if self.pid_namespace is not None:
                if per_command_view and self.pid_namespace.mount_ns is not None:
                    # A view is built from the host's mounts (the session's own filesystem, mounted
                    # after this server started), not from the namespace's copy: the init joins them.
                    params["host_mounts_fd"] = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
                self.pid_namespace.enter()
                params["parent_pid"] = self.pid_namespace.parent_pid_inside
            if per_command_view and self.base_mounts is not None:
                params["base_mounts_fd"] = self.base_mounts
            for fd in (self.wake_r, self.wake_w, self.worker):
                os.close(fd)
            self.sel.close()
            if isinstance(self.pid_namespace, namespaces.ServerInit):
                # The relay's sockets (its thread may have accepted one as we forked) and the other
                # views: a copy held here would keep a connection open past the relay's close.
                keep = [*self.pid_namespace.held(), *params.get("view_fds", ())]
                keep += [fd for fd in (params.get("base_mounts_fd"), self.busy) if fd is not None]
                _close_all_but(sorted(set(keep)))
            null = os.open(os.devnull, os.O_RDWR)
            log = os.open(params["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.dup2(log, 2)
            os.close(null)
            os.close(log)
            os.chdir(params["cwd"])
            return supervisor.run(params, req.get("env"))

        proctree.end_child("supervisor", child)

    def _view(self, steps: list[list[str]]) -> tuple[int, int] | None:
        """The mount and IPC namespaces of the sandbox's view ``steps`` (sandboxes/fsview.py), built at the
        sandbox's start (or else its first command) with that namespace's /proc (``_build_view_here``, else
        a child born in the namespace), held here by descriptor for each command's init to join: a view
        costs ~25 clones and mounts, and their tear-down at the command's exit, once per sandbox rather
        than once per command. What commands may write in it (/tmp, /dev/shm, IPC objects) then lasts
        across the sandbox's commands, as its work, home and tmp do; no other sandbox joins it, and no
        command can change its mounts (each runs without CAP_SYS_ADMIN or a way to regain it). None where
        it could not be built: each command's init then builds its own, and says why not."""
        key = json.dumps(steps)
        if key not in self.views:
            proc = self.pid_namespace.proc if self.pid_namespace is not None else None
            view = None
            if self.base_mounts is not None and proc is not None:
                view = _build_view_here(steps, self.base_mounts, proc)
            if view is None:
                view = _build_view(steps, self.base_mounts, (self.wake_r, self.wake_w, self.worker))
            self.views[key] = view
        return self.views[key]

    def read_requests(self) -> None:
        try:
            chunk = os.read(0, supervisor.READ_CHUNK)
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
        for pid, status in proctree.exited_children():
            req_id = self.children.pop(pid, None)
            if req_id is not None:
                self.reply({"id": req_id, "status": status})
            elif self.pid_namespace is not None and pid == self.pid_namespace.init_pid:
                self.pid_namespace.init_reaped = True  # its pid is free for reuse from here on
            for job in self.folded.values():
                if job.current is not None and job.current.pid == pid and job.current.status is None:
                    job.current.status = status

    def hand_on(self) -> int | None:
        """Serve the next sandbox: the namespace emptied and ready for it (namespaces.ServerInit), and
        nothing of the ended sandbox's kept (its views, its uid's lock), as a new server would have
        nothing; None once we do. Else our exit code: 1 where the namespace could not be emptied (the
        sandbox's stop says what is left), 0 where it is empty but not ready (we end as at the end of
        our requests)."""
        namespace, token = self.pid_namespace, self.next_wanted
        assert isinstance(namespace, namespaces.ServerInit) and token is not None and self.marker_at
        self.next_wanted = None
        if not namespace.end(namespaces.NAMESPACE_END_S, self.wake_r):
            return 1
        if not namespace.ready_for_next():
            return 0
        for view in self.views.values():
            for fd in view or ():
                os.close(fd)
        self.views.clear()
        if self.busy is not None:  # the uid is free for another sandbox once none of its processes is left
            os.close(self.busy)
            self.busy = None
        self.uid_taken = False
        set_marker(self.marker_at, token)  # what our later supervisors carry too: the next sandbox's
        self.reply({"next": True})
        return None

    def serve(self) -> int:
        # Bounded by the worker: it closes stdin when the sandbox stops, and each supervisor is bounded by
        # its command's timeout and the sandbox's TTL.
        while self.stdin_open or self.children or self.folded:
            if self.next_wanted is not None and not (self.children or self.folded or self.stop_signal):
                if (code := self.hand_on()) is not None:
                    return code
                continue
            if self.stop_signal is not None:
                proctree.send(self.children, signal.SIGTERM)  # each ends its tree and records "terminated"
                for job in self.folded.values():
                    job.signal(self.stop_signal)
                self._settle()
                return 0
            # No timeout but a folded command's: each thing we wait for (a request, a supervisor's exit, a
            # stop signal through the wake-up pipe, the worker's death, output) makes a descriptor
            # readable. A sandbox that waits on its harness for minutes costs nothing here (a 1 s poll
            # cost ~0.1 ms of CPU a second each).
            due = min((job.current.due() for job in self.folded.values() if job.current), default=None)
            for key, _events in self.sel.select(None if due is None else max(0.0, due - time.monotonic())):
                if key.data is not None:  # a folded command's output
                    if not key.data.read(key.fd):
                        self.sel.unregister(key.fd)
                elif key.fd == self.wake_r:
                    supervisor.drain_wakeup(self.wake_r)
                elif key.fd == 0:
                    self.read_requests()
                elif key.fd == self.worker:
                    self.stop_signal = signal.SIGTERM
            self.reap()
            self._settle()
        return 0


def _build_view_here(steps: list[list[str]], base_mounts: int, proc: int) -> tuple[int, int] | None:
    """Build the view with no fork: by the native init's view mode where it is built
    (``_build_view_natively``), else in this server: unshare its mount and IPC namespaces from the base,
    build it, open them, and join our own again (we are single-threaded, as ``setns`` needs). Its /proc
    is a clone of the PID namespace's procfs, which the init made (a procfs mounted here would be the
    host's PID namespace's). A fork, and its copy of this process's pages, less per sandbox. None where
    the kernel cannot clone a detached mount (before 6.15), or the view could not be built: the caller
    then forks a child that builds it, and says why not."""
    try:
        proc_clone = fsview.clone_mount(proc)
    except OSError:
        return None
    if native_init.PROGRAM is not None:
        try:
            if (view := _build_view_natively(steps, base_mounts, proc_clone)) is not None:
                return view
        finally:  # moved into a view that failed, it is no clone to move again
            os.close(proc_clone)
        try:
            proc_clone = fsview.clone_mount(proc)
        except OSError:
            return None
    kinds = ("mnt", "ipc")
    ours = [os.open(f"/proc/self/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC) for kind in kinds]
    host_proc = os.open("/proc", os.O_PATH | os.O_CLOEXEC)  # the view's /proc has no `self` for us
    umask = os.umask(0o022)
    opened: list[int] = []
    try:
        sources = fsview.clone_sources(steps)
        proctree.libc_call("setns", base_mounts, namespaces.CLONE_NEWNS)
        proctree.libc_call("unshare", namespaces.CLONE_NEWNS | CLONE_NEWIPC)
        fsview.apply(steps, sources, proc_clone)
        for kind in kinds:
            opened.append(os.open(f"self/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=host_proc))
    except Exception:  # the child the caller forks instead meets it too, and says what it was
        for fd in opened:
            os.close(fd)
        opened = []
    finally:
        try:
            for fd, kind in zip(ours, (namespaces.CLONE_NEWNS, CLONE_NEWIPC), strict=True):
                proctree.libc_call("setns", fd, kind)  # our root and working directory: the host's again
        except BaseException as exc:  # a server left in a view must serve nothing more
            os.write(2, f"supervisor server: cannot leave a view: {exc}\n".encode(errors="replace"))
            os._exit(1)
        os.umask(umask)
        for fd in (*ours, host_proc, proc_clone):
            os.close(fd)
    return (opened[0], opened[1]) if opened else None


def _build_view_natively(steps: list[list[str]], base_mounts: int, proc: int) -> tuple[int, int] | None:
    """The view built by the native init's view mode (native_init.py), as ``_build_view_here`` builds it
    here: no line of Python per mount, and none of our pages copied (posix_spawn). None where it could
    not be: the caller builds it itself, and meets the reason."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    try:
        pid = native_init.start_view(steps, base_mounts, proc, ready_w, hold_r)
    except OSError:
        for fd in (ready_r, ready_w, hold_r, hold_w):
            os.close(fd)
        return None
    os.close(ready_w)
    os.close(hold_r)
    return _views_namespaces(pid, ready_r, hold_w)


def _build_view(
    steps: list[list[str]], base_mounts: int | None, close: tuple[int, ...]
) -> tuple[int, int] | None:
    """Fork a child (born in our PID namespace) that builds the view in a mount and IPC namespace of
    its own, as a command's init would (spawn._init), and waits; open its namespaces, then let it go.
    Bounded: the child says it is ready, or dies and its pipe ends."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        for fd in (ready_r, ready_w, hold_r, hold_w):
            os.close(fd)
        return None
    if pid == 0:

        def view() -> int:
            proctree.name_process(b"rollout-view")
            signal.set_wakeup_fd(-1)  # the server's wake-up pipe is not ours to write
            for fd in (ready_r, hold_w, *close):
                os.close(fd)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)  # the server's request and answer pipes are not ours
            os.dup2(null, 1)
            os.close(null)
            sources = None
            if base_mounts is not None:  # the binds from the host's tree, the namespace from the base
                sources = fsview.clone_sources(steps)
                proctree.libc_call("setns", base_mounts, namespaces.CLONE_NEWNS)
            proctree.libc_call("unshare", namespaces.CLONE_NEWNS | CLONE_NEWIPC)
            fsview.apply(steps, sources)
            os.write(ready_w, b"1")
            os.read(hold_r, 1)  # until the server has opened our namespaces (or died)
            return 0

        proctree.end_child("sandbox view", view)
    os.close(ready_w)
    os.close(hold_r)
    return _views_namespaces(pid, ready_r, hold_w)


def _views_namespaces(pid: int, ready_r: int, hold_w: int) -> tuple[int, int] | None:
    """The mount and IPC namespaces of ``pid``, a child of ours that builds a view, once it says it has
    (a "1" on ``ready_r``), then its hold (``hold_w``) let go; None where it ended without. Bounded: the
    child says it is ready, or ends and its pipe with it."""
    opened: list[int] = []
    try:
        if os.read(ready_r, 1) == b"1":
            for kind in ("mnt", "ipc"):
                opened.append(os.open(f"/proc/{_host_pid(pid)}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        pass
    finally:
        os.close(ready_r)
        os.close(hold_w)  # the child exits; reaped with the supervisors
    if len(opened) == 2:
        return opened[0], opened[1]
    for fd in opened:
        os.close(fd)
    return None


def _host_pid(pid: int) -> int:
    """``pid``, a child of ours, as the host's /proc (ours) names it: only a server that is its PID
    namespace's init (namespaces.ServerInit) is pid 1, and its children's pids are the namespace's."""
    return namespaces.host_pid(pid) if os.getpid() == 1 else pid


def _close_all_but(keep: list[int]) -> None:
    """Close every descriptor from 3 up but ``keep`` (sorted)."""
    low = 3
    for fd in keep:
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, spawn.MAX_FD)


def _hold_shared(path: str) -> int | None:
    for _ in range(1000):  # a leaser holds it exclusively for microseconds at a time
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            os.close(fd)
        time.sleep(0.001)
    return None


def serve(
    worker: int,
    pid_namespace: bool,
    network: tuple[int, str] | None,
    base_mounts: int | None = None,
    views: bool = False,
    as_init: bool = False,
    network_ns: int | None = None,
    marker_at: int | None = None,
) -> int:
    """Serve the worker's requests on stdin until it closes them (or dies: ``worker`` is its pidfd).
    ``base_mounts``: a mount namespace of one empty tmpfs that each command's view is unshared from.
    ``views``: every command of the sandbox has a view; with ``base_mounts``, its PID namespace then
    needs no mount namespace of its own (namespaces.py). ``as_init``: we were forked as the init of the
    sandbox's PID namespace (namespaces.ServerInit), which needs both; then, with ``marker_at`` (where
    our environment block holds the marker), we can serve later sandboxes too (``_Server.hand_on``)."""
    # Forked into a PID namespace of its own (``as_init``), we are its pid 1: the worker knows us by the
    # host's pid, which the host's /proc (our mount namespace's) names as "self".
    ready = int(os.readlink("/proc/self")) if as_init else os.getpid()
    own_mounts = not (views and base_mounts is not None)
    # Whether a mount the worker makes on the host after now (a session's tmpfs: diskfs.py) is where our
    # supervisors look: not in a PID namespace's own copy of the host's mounts, which it never reaches.
    later_mounts = as_init or not pid_namespace or not own_mounts
    reusable = as_init and marker_at is not None
    write_line(1, {"ready": ready, "reusable": reusable, "later_mounts": later_mounts})
    # What is alive now lives as long as we do: no collection need walk it, in here or in a forked child,
    # where a walk would copy every page it touches.
    gc.freeze()
    code = 1
    try:
        held = (worker,) if base_mounts is None else (worker, base_mounts)
        namespace: namespaces.PidNamespace | namespaces.ServerInit | None = None
        if as_init:
            namespace = namespaces.ServerInit(network, network_ns)
        elif pid_namespace:
            namespace = namespaces.PidNamespace(network, held, own_mounts=own_mounts)
        server = _Server(worker, namespace, base_mounts, marker_at if as_init else None)
        server.install_signals()
        code = server.serve()
        # Exit 0 only once the namespace is empty: the sandbox's stop() then needs no sweep of /proc.
        if namespace is not None and not namespace.end(namespaces.NAMESPACE_END_S, server.wake_r):
            code = 1
    finally:
        write_line(1, {"exit": code})
    return code


def main(argv: list[str]) -> int:
    # What an isolated command's init imports (spawn._init), once here rather than in every init:
    # ~10 ms a command, paid instead while this server waits as a spare at the lowest CPU priority.
    import fsview  # noqa: F401
    import netns  # noqa: F401
    import pidlimit  # noqa: F401
    import seccomp  # noqa: F401

    usage = "usage: supervisor_server.py --serve PARENT_PID [--pid-namespace [--network PORT SOCKET]]"
    options = argv[3:]
    network_flags = ["--pid-namespace", "--network"]
    with_network = len(options) == 4 and options[:2] == network_flags and options[2].isdigit()
    if len(argv) < 3 or argv[1] != "--serve" or not (options in ([], ["--pid-namespace"]) or with_network):
        print(usage, file=sys.stderr)
        return 2
    proctree.name_process(b"rollout-server")
    spawn.new_session_keyring()  # nothing of the worker's keyring for the sandbox's commands
    parent = int(argv[2])
    worker = os.pidfd_open(parent)
    if os.getppid() != parent:
        os._exit(0)  # the worker died before its pidfd was open: its sandbox is gone
    code = serve(worker, bool(options), (int(options[2]), options[3]) if with_network else None)
    os._exit(code)  # nothing to flush or finalize: the sandbox's stop() waits for this exit


if __name__ == "__main__":
    sys.exit(main(sys.argv))
