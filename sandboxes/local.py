"""The ``local`` sandbox: a private directory tree per session; every command runs under a supervisor.

Layout of one session, ``<root>/<run_id>/<session_id>/`` (a tmpfs of its own unless kept, as root:
diskfs.py)::

    disk/         the sandbox's own filesystem where it has one (a tmpfs of its disk bound: diskfs.py),
                  else these are directly in the session's directory:
      work/         the workspace (``sandbox.workdir``)
      home/         HOME, with the XDG directories under it
      tmp/          TMPDIR
      passwd, group its user's account files, bound at /etc in its view
    logs/         <name>.stdout / <name>.stderr of each exec, capped
    run/          each exec's supervisor result; the supervisors' log
    sandbox.json  the descriptor another process uses to reap this sandbox; it names the owner

The owner is the process that started the sandbox, proven alive by the lock on its record
``<root>/owners/<name>`` (sandboxes/owner.py); a reaper ends only sandboxes whose owner is dead or whose
TTL has passed. A run's state stays under ``<root>/<run_id>/``, so runs sharing a root meet only there.

Commands reach their supervisors through the sandbox's supervisor server (sandboxes/exec_server.py),
which forks one per command; the server itself is forked by the provider's fork server
(sandboxes/zygote.py), or started as an interpreter of its own once that has died too often.
Processes are ended three ways, so that no one mechanism has to be perfect: each exec's supervisor
kills its tree (on exit, timeout, TTL, SIGTERM and the worker's death), the sandbox kills a
supervisor's tree from outside when the supervisor overruns, and ``stop``/``reap_stale`` sweep /proc
for every process that carries the sandbox's environment marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandboxes import diskfs, identity, isolation, owner, pidlimit, uidpool
from sandboxes import supervisor as sup
from sandboxes.base import (
    SandboxError,
    SandboxSpec,
    SandboxStartError,
    check_session_names,
)
from sandboxes.environment import (
    SANDBOX_MARKER_VAR,
)
from sandboxes.exec_server import ExecServer, Zygote, ZygoteGone
from sandboxes.provider_config import NetworkForward

log = logging.getLogger(__name__)

DEFAULT_OUTPUT_CAP_BYTES = 64 * 1024 * 1024
DEFAULT_NOFILE_LIMIT = 65_536
DISK_SHARE = 0.75  # of the memory cap, at most, for a sandbox's tmpfs disk (diskfs.py)
SUPERVISOR_SLACK_S = sup.SLACK_S
# Fork servers a provider starts before it starts each sandbox's server as a new interpreter instead.
MAX_ZYGOTE_STARTS = 3
# How long a provider's close waits for the stops and directory removals under way (each bounded itself).
CLOSE_WAIT_S = 120.0
# Caps of ended sandboxes kept for later ones (``keep_caps``): as many as end at once between two
# starts, at most this many.
MAX_SPARE_CAPS = 64
# Servers of ended sandboxes kept for later ones (``keep_server``), at most this many: each holds ~3 MB
# and its sandbox's caps while it waits.
MAX_IDLE_SERVERS = 64

# The provider's parts, each a module of its own; their names stay importable from here.
from sandboxes.local_files import confined_path, copy_tree, write_confined  # noqa: E402, F401
from sandboxes.local_reap import (  # noqa: E402, F401
    _REMOVING_SUFFIX,
    DEFAULT_KILL_GRACE_S,
    DESCRIPTOR_NAME,
    reap_stale,
)
from sandboxes.local_sandbox import LocalSandbox, remove_caps  # noqa: E402


class LocalSandboxProvider:
    """Starts local sandboxes under ``root``. ``keep=False`` removes a session's directory at stop."""

    starts_in_milliseconds = True  # see sandboxes.base.StartsInMilliseconds

    def __init__(
        self,
        root: Path,
        name: str = "local",
        *,
        keep: bool = True,
        output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES,
        kill_grace_s: float = DEFAULT_KILL_GRACE_S,
        nofile_limit: int = DEFAULT_NOFILE_LIMIT,
        path_prefixes: Sequence[str] = (),
        supervisor_slack_s: float = SUPERVISOR_SLACK_S,
        network_forward: NetworkForward | None = None,
        pids: isolation.PidsMode = "host",
        filesystem: isolation.FilesystemMode = "host",
        user: bool = False,
        hidden: Sequence[str] = (),
        max_processes: int | None = None,
        max_file_mb: int | None = None,
        max_disk_mb: int | None = None,
        max_memory_mb: int | None = None,
        mounts: Sequence[tuple[str, bool]] = (),
    ) -> None:
        self.root = Path(root).resolve()
        self.name = name
        self.keep = keep
        self.output_cap_bytes = output_cap_bytes
        self.kill_grace_s = kill_grace_s
        self.nofile_limit = nofile_limit
        self.path_prefixes = tuple(path_prefixes)
        self.supervisor_slack_s = supervisor_slack_s
        self.max_processes = max_processes  # where the host has a pids cgroup for it (pidlimit.py)
        if max_processes:
            pidlimit.sweep()  # what sandboxes of dead owners left
        self.max_file_bytes = max_file_mb * 1024 * 1024 if max_file_mb else None
        self.max_disk_bytes = max_disk_mb * 1024 * 1024 if max_disk_mb else None
        self.max_memory_bytes = max_memory_mb * 1024 * 1024 if max_memory_mb else None
        if max_memory_mb:
            pidlimit.sweep(pidlimit.MEMORY)
        self.mounts = list(mounts)
        self._server_log = self.root / "supervisor-servers.log"
        self._spare: tuple[asyncio.AbstractEventLoop, asyncio.Future[ExecServer]] | None = None
        # Servers whose sandboxes have ended, their namespaces empty, for later sandboxes (``keep_server``).
        self._idle: list[ExecServer] = []
        self._closing = False
        # The fork server of supervisor servers (sandboxes/zygote.py), started with the first sandbox.
        self._zygote: Zygote | None = None
        self._zygote_starts = 0
        # A spare starts at the lowest CPU priority while the machine may need the CPU for a harness, and
        # gets the normal one back when taken; False once this process turns out not to be allowed to.
        self._spare_nice = True
        self._removals: set[asyncio.Task[None]] = set()
        self._stops: set[asyncio.Task[None]] = set()  # sandboxes' stops under way (LocalSandbox.stop)
        # The process and memory caps of ended sandboxes, empty, for later ones (``keep_caps``).
        self._spare_caps: list[dict[str, str]] = []
        # pids/filesystem/user: see sandboxes/isolation.py. Raises IsolationUnavailable if the host cannot.
        # network_forward (port, unix socket): every command runs in a loopback-only network namespace of
        # its own, where 127.0.0.1:port reaches the gateway through that socket (sandboxes/netns.py).
        pid_ns = isolation.resolve_pids(pids, filesystem)
        view_maker = isolation.view_maker() if filesystem == "readonly" else "host"
        if user:
            why = uidpool.pool_unavailable()
            if why is None and view_maker != "mounts":
                why = "an unprivileged user needs root's filesystem view"
            if why is not None:
                raise isolation.IsolationUnavailable(f"sandbox user: {why}")
        self.isolation = isolation.Isolation(
            pids=pid_ns, filesystem=view_maker, network_forward=network_forward, user=user
        )
        # The disk bound kept by the filesystem where root's view binds it in (diskfs.py), else watched.
        self.disk_fs = bool(self.max_disk_bytes) and view_maker == "mounts" and diskfs.unavailable() is None
        # A session directory no one keeps is a tmpfs where its server's commands see it (diskfs.py).
        self.session_fs = not keep and diskfs.unavailable() is None and isolation.mounts_unavailable() is None
        self.mount_points = diskfs.MountPoints()  # what those tmpfs are mounted on, kept for later sessions
        # What no command may see besides homes and /tmp: every sandbox's directory, the run's directory.
        self.hidden: list[str] = [str(self.root), *hidden]

    @property
    def isolation_label(self) -> str:
        """The layers every command runs under, as a row records them (``Row.sandbox_isolation``)."""
        return self.isolation.label

    def hide(self, path: Path) -> None:
        """Keep ``path`` (the run directory) out of every later sandbox's view."""
        self.hidden.append(str(path))

    async def start(self, spec: SandboxSpec) -> LocalSandbox:
        check_session_names(spec)
        session_dir = self.root / spec.run_id / spec.session_id
        try:
            owner_name = owner.hold(self.root)  # once per process: later calls are a lookup and an fstat
        except OSError as exc:
            raise SandboxStartError(f"cannot make an owner record under {self.root}: {exc}") from exc
        lease = None
        if self.isolation.user:  # a uid no other running sandbox has (uidpool.py): microseconds
            try:
                lease = uidpool.lease()
            except OSError as exc:
                raise SandboxStartError(f"cannot lease a uid for the sandbox: {exc}") from exc
        try:
            server = await self._take_server()
        except OSError as exc:
            if lease is not None:
                lease.release()
            raise SandboxStartError(f"cannot start a supervisor server: {exc}") from exc
        try:
            sandbox = LocalSandbox(self, spec, session_dir, server, owner_name, lease)
        except SandboxError as exc:
            await self._discard(server, self.kill_grace_s)
            if lease is not None:
                lease.release()
            raise SandboxStartError(str(exc)) from exc

        sandbox.session_fs = self.session_fs and server.later_mounts

        def in_session_dir() -> None:
            self._fill_session_dir(session_dir, sandbox)
            sandbox._write_descriptor(create=True)

        def on_disk() -> None:
            if not server.cgroups:  # a spare's are made and joined while the sandbox before it ran
                server.cgroups = self._cap(server)
            sandbox.pids_cgroup = server.cgroups.get(pidlimit.PIDS)
            sandbox.memory_cgroup = server.cgroups.get(pidlimit.MEMORY)
            if sandbox.memory_cgroup and sandbox.memory_max != self.max_memory_bytes:  # the task's own
                assert sandbox.memory_max
                pidlimit.set_limit(sandbox.memory_cgroup, sandbox.memory_max, pidlimit.MEMORY)
            self._make_session_dir(session_dir, sandbox)
            if not sandbox.session_fs:
                in_session_dir()

        async def lay_out() -> None:
            # What can wait on the kernel for milliseconds (a cgroup made and joined, a limit written, a
            # dozen inodes made on a busy disk) goes to a thread, not the event loop a worker's hundred
            # other sessions share. A session directory of memory (its own tmpfs) costs the disk one mkdir
            # and the kernel one mount (~65 us), and is filled in microseconds a call: on the event loop,
            # where a thread's hand-off (two context switches, the interpreter's lock back and forth at
            # each of its calls) costs more than the calls (~0.5 ms of a worker's CPU a session with the
            # stop's, measured).
            if sandbox.session_fs and self._capped(server, sandbox):
                on_disk()
            else:
                await asyncio.to_thread(on_disk)
            if sandbox.session_fs:
                in_session_dir()

        laying = asyncio.ensure_future(lay_out())
        try:
            await asyncio.shield(laying)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):  # whatever it made, stop() undoes as for any sandbox
                await laying
            await asyncio.shield(sandbox.stop())
            raise
        except OSError as exc:
            await self._discard(server, self.kill_grace_s)
            await asyncio.to_thread(sandbox._unmount_disk)
            if lease is not None:
                lease.release()
            if isinstance(exc, FileExistsError):
                raise SandboxStartError(f"sandbox directory {session_dir} already exists") from exc
            raise SandboxStartError(f"cannot lay out sandbox directory {session_dir}: {exc}") from exc
        sandbox.prepare_view()
        return sandbox

    def _capped(self, server: ExecServer, sandbox: LocalSandbox) -> bool:
        """Whether ``sandbox``'s caps need no cgroup made, joined or written: ``server``'s (a spare's,
        an ended sandbox's) are there, or there are none to have, and the sandbox takes the run's limit."""
        wanted = self.max_processes or self.max_memory_bytes
        return (bool(server.cgroups) or not wanted) and sandbox.memory_max == self.max_memory_bytes

    async def _take_server(self) -> ExecServer:
        """An ended sandbox's server (``keep_server``), else the spare if there is a live one, else a new
        one. A server's interpreter start-up and imports take tens of milliseconds, which a spare moves
        off the session's path."""
        loop = asyncio.get_running_loop()
        while self._idle:
            idle = self._idle.pop()
            if idle.loop is not loop:
                continue  # a closed loop's: its transport ends it
            with contextlib.suppress(OSError):
                if idle.alive:
                    self._limit_again(idle.cgroups)  # a few small writes: microseconds
                    return idle
            await self._discard(idle, 0)
        spare, self._spare = self._spare, None
        server: ExecServer | None = None
        # A spare of another event loop (a closed one) cannot be used here; its transport ends it.
        if spare is not None and spare[0] is loop:
            # Done: at once. Still starting: waiting for it is no slower than starting a new one.
            with contextlib.suppress(OSError):
                server = await spare[1]
            if server is not None and not (server.alive and self._normal_priority(server)):
                await self._discard(server, 0)
                server = None
        if server is None:
            server = await self._new_server()
        return server

    def _normal_priority(self, server: ExecServer) -> bool:
        """Give a taken spare, and so every command it will run, the normal CPU priority back."""
        try:
            os.setpriority(os.PRIO_PGRP, server.pid, 0)  # the server leads its group, with its init
        except PermissionError:  # no CAP_SYS_NICE, nor an RLIMIT_NICE that allows it
            log.info("sandboxes: cannot restore a spare's CPU priority; later spares keep the normal one")
            self._spare_nice = False
            return False
        except ProcessLookupError:
            return False
        return True

    def want_spare(self) -> None:
        """Start a spare server for the next sandbox, if none is there: called once a sandbox's command
        runs, so that its start-up does not delay a session's setup on this event loop. The start-up
        itself runs at the normal priority; once up, the spare waits at the lowest until taken (a nice
        that a kernel grouping CPU by session, autogroup, applies within its own session only)."""
        loop = asyncio.get_running_loop()
        if any(idle.loop is loop for idle in self._idle):
            return  # the next sandbox takes an ended one's server
        if self._spare is None or self._spare[0] is not loop:
            self._spare = (loop, asyncio.ensure_future(self._new_spare()))

    async def _new_spare(self) -> ExecServer:
        server = await self._new_server()
        if self._spare_nice:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PGRP, server.pid, 19)
        if self.max_processes or self.max_memory_bytes:
            # Its sandbox's caps, made now rather than on the next session's path: moving a process into
            # a cgroup waits for an RCU grace period (~10 ms with cgroup v1).
            server.cgroups = await asyncio.to_thread(self._cap, server)
        return server

    def _cap(self, server: ExecServer) -> dict[str, str]:
        """The process and memory caps for the sandbox ``server`` will serve (cgroup.procs by controller),
        with ``server`` in them, so that every command's init is born there; none where the host has none.
        A server that could not be moved leaves each init to join the caps itself (slower, as capped).
        An ended sandbox's caps where there are any (``keep_caps``), else new ones."""
        while True:
            try:
                kept = self._spare_caps.pop()  # atomic: spares are capped in threads
            except IndexError:
                break
            if self._recap(kept, server):
                return kept
        groups: dict[str, str] = {}
        for controller, limit in (
            (pidlimit.PIDS, self.max_processes),
            (pidlimit.MEMORY, self.max_memory_bytes),
        ):
            group = pidlimit.make(server.marker_token, limit, controller) if limit else None
            if group:
                if controller == pidlimit.MEMORY:
                    pidlimit.spare_from_oom_killer(server.pid)
                if group not in groups.values():  # cgroup v2: one group holds both
                    pidlimit.adopt(group, server.pid)
                groups[controller] = group
        return groups

    def _limit_again(self, groups: dict[str, str]) -> None:
        """This provider's limits on an ended sandbox's caps again, whatever it left (a task's own memory
        cap). Raises OSError where that fails (a limit below what the group still holds)."""
        limits = {pidlimit.PIDS: self.max_processes, pidlimit.MEMORY: self.max_memory_bytes}
        for controller, group in groups.items():
            if not os.path.isdir(os.path.dirname(group)):  # swept meanwhile by another provider
                raise OSError(f"{group}: gone")
            limit = limits[controller]
            if not limit:
                raise OSError(f"{group}: no {controller} cap here")
            pidlimit.set_limit(group, limit, controller)

    def _recap(self, groups: dict[str, str], server: ExecServer) -> bool:
        """Take an ended sandbox's caps for ``server``: this provider's limits again, ``server`` moved in.
        False, and the groups removed, where that fails."""
        try:
            self._limit_again(groups)
        except OSError:
            for group in set(groups.values()):
                pidlimit.remove(group)
            return False
        if pidlimit.MEMORY in groups:
            pidlimit.spare_from_oom_killer(server.pid)
        for group in set(groups.values()):
            pidlimit.adopt(group, server.pid)
        return True

    def keep_caps(self, groups: dict[str, str]) -> bool:
        """Keep an ended sandbox's caps, empty (its PID namespace ended with every process in it), for a
        later sandbox: a cgroup made, capped and removed costs ~0.5 ms of the machine's CPU (a pids one)
        to ~1 ms (a memory one), one moved into and capped again microseconds. False when enough are
        kept: the caller removes them."""
        if not groups or len(self._spare_caps) >= MAX_SPARE_CAPS:
            return False
        self._spare_caps.append(groups)
        return True

    def may_hand_on(self, server: ExecServer) -> bool:
        """Whether ``server``, its sandbox ended, may serve a later one (``ExecServer.hand_on``): one that
        is its PID namespace's init, where no command ran as root (none could have changed the network
        namespace it keeps, nor reached the server: the same bounds as ``network_handed_on``)."""
        return server.reusable and self.isolation.user

    async def keep_server(self, server: ExecServer, *, usable: bool) -> None:
        """Keep a server whose sandbox has ended and whose namespace is empty for a later sandbox: a
        forked server's start, its caps' move and its exit cost ~3 ms of a sandbox's processes' CPU (its
        pages copied again, its interpreter torn down), one kept microseconds. Ended when enough are
        kept, or when its sandbox's stop failed after it (``usable`` False), its caps with it."""
        if usable and len(self._idle) < MAX_IDLE_SERVERS and server.alive and not self._closing:
            self._idle.append(server)
        else:
            await self._discard(server, self.kill_grace_s)

    def reclaim(self, server: ExecServer, marker_token: str) -> bool:
        """Take back a server kept by ``keep_server`` that no sandbox has taken since: True if it was
        still kept (it is then the caller's again). ``marker_token``: the marker it was handed on with; a
        server that has served another sandbox since, and was kept again, has another (that sandbox's
        caps, not the caller's, are then the ones it is in)."""
        if server in self._idle and server.marker_token == marker_token:
            self._idle.remove(server)
            return True
        return False

    async def _discard(self, server: ExecServer, timeout: float) -> None:
        """End a server no sandbox took, and the cap made for it."""
        await server.close(timeout)
        await remove_caps(server.cgroups.values())

    async def _new_server(self) -> ExecServer:
        token = uuid.uuid4().hex
        # Not yet any sandbox's: it runs from / and carries only its marker, which the sandbox adopts.
        options: dict[str, Any] = {
            "env": {SANDBOX_MARKER_VAR: token},
            "marker_token": token,
            "log_path": self._server_log,
            "pid_namespace": isolation.server_pid_namespace(self.isolation),
            "network_forward": isolation.server_network(self.isolation),
            # Every command builds its own view (from the fork server's base): the PID namespace needs
            # no copy of the host's mount table for its /proc (namespaces.py).
            "views": self.isolation.filesystem == "mounts",
            # Every command runs as the sandbox's own uid, never root: none can change the namespace
            # (its loopback, routes, filters need CAP_NET_ADMIN), which an ended sandbox's then is again.
            "network_handed_on": self.isolation.user,
        }
        while (zygote := self._live_zygote()) is not None:
            try:
                return await ExecServer.start(zygote=zygote, **options)
            except ZygoteGone:
                await zygote.close()  # the next round starts another, or none
        return await ExecServer.start(**options)

    def _live_zygote(self) -> Zygote | None:
        """The fork server, started again if it has died, at most ``MAX_ZYGOTE_STARTS`` times in all;
        None from then on. Its first death and the giving up are each said once."""
        zygote = self._zygote
        if zygote is not None and zygote.alive:
            return zygote
        if zygote is not None and self._zygote_starts == 1:
            log.warning(
                "sandboxes: the supervisor fork server (pid %d) exited with status %s; starting another "
                "(after %d, each sandbox's supervisor server starts as a new interpreter)",
                zygote.pid,
                zygote.returncode,
                MAX_ZYGOTE_STARTS,
            )
        self._zygote = None
        if self._zygote_starts >= MAX_ZYGOTE_STARTS:
            if zygote is not None:  # the last one: from here on, nothing to say
                log.warning(
                    "sandboxes: the supervisor fork server exited %d times; each sandbox's supervisor "
                    "server now starts as a new interpreter",
                    MAX_ZYGOTE_STARTS,
                )
            return None
        self._zygote_starts += 1
        try:
            self._zygote = Zygote(self._server_log)
        except OSError as exc:
            log.warning("sandboxes: cannot start the supervisor fork server: %s", exc)
        return self._zygote

    async def aclose(self) -> None:
        """Finish the stops begun and the removal of stopped sandboxes' directories, then end the spare
        supervisor server and the ended sandboxes' servers kept. Sandboxes not being stopped are not
        affected."""
        self._closing = True  # a stop that ends meanwhile ends its server rather than keep it
        try:
            await self.finish_removals()
            spare, self._spare = self._spare, None
            if spare is not None and spare[0] is asyncio.get_running_loop():
                with contextlib.suppress(Exception):
                    await self._discard(await spare[1], self.kill_grace_s)
            idle, self._idle = self._idle, []
            ours = [server for server in idle if server.loop is asyncio.get_running_loop()]
            await asyncio.gather(*(self._discard(server, self.kill_grace_s) for server in ours))
            zygote, self._zygote = self._zygote, None
            if zygote is not None:
                await zygote.close()
            kept, self._spare_caps = self._spare_caps, []
            for groups in kept:
                for group in set(groups.values()):
                    await asyncio.to_thread(pidlimit.remove, group, 2.0)
            await asyncio.to_thread(self.mount_points.close)
        finally:
            self._closing = False

    async def finish_removals(self) -> None:
        """Wait for the stops begun so far, whoever gave up waiting for them, and then for the deletions
        of stopped sandboxes' directories (a stop's last step begins its sandbox's). Bounded: a stop is
        bounded by its own steps; past ``CLOSE_WAIT_S`` what is left is said, and its descriptor leads a
        reaper (``rollout gc``, the next run's start) to it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_WAIT_S
        for pending in (self._stops, self._removals):
            tasks = {task for task in pending if task.get_loop() is loop}
            if tasks:
                _done, late = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
                if late:
                    what = "sandbox stops" if pending is self._stops else "directory removals"
                    log.warning("sandboxes: %d %s under way after %.0f s", len(late), what, CLOSE_WAIT_S)

    def finish_at_close(self, task: asyncio.Task[None]) -> None:
        """Hold a sandbox's stop until it ends: ``aclose`` waits for it, whoever else stopped waiting."""
        self._stops.add(task)
        task.add_done_callback(self._stop_ended)

    def _stop_ended(self, task: asyncio.Task[None]) -> None:
        self._stops.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:  # retrieved: a caller says it
            log.debug("sandboxes: a stop failed: %s", str(exc)[:500])

    def remove_later(self, session_dir: Path, owner_name: str) -> None:
        """Move a stopped sandbox's directory aside at once and delete it off the session's path: a
        harness's home holds hundreds of files, 10-40 ms of unlinking that no row needs to wait for. The
        aside's name says whose deletion it is, so only a dead owner's is finished by a reaper."""
        aside = session_dir.with_name(f"{session_dir.name}.{owner_name}{_REMOVING_SUFFIX}")
        try:
            os.rename(session_dir, aside)
        except OSError:
            aside = session_dir
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(shutil.rmtree, aside, True))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    def _make_session_dir(self, session_dir: Path, sandbox: LocalSandbox) -> None:
        session_dir.parent.mkdir(parents=True, exist_ok=True)
        if not sandbox.session_fs:
            session_dir.mkdir(mode=0o700)
        else:
            self.mount_points.make(str(session_dir))  # an ended session's mount point, where one is kept
            try:
                diskfs.mount_session(str(session_dir))
            except OSError as exc:  # the directory on the disk, as for a kept one: this and later ones
                sandbox.session_fs = self.session_fs = False
                log.warning("sandboxes: session directories on the disk: %s", str(exc)[:300])

    def _fill_session_dir(self, session_dir: Path, sandbox: LocalSandbox) -> None:
        for sub in ("logs", "run"):
            (session_dir / sub).mkdir(mode=0o700)
        if self.disk_fs:
            assert self.max_disk_bytes
            # Its pages count toward the memory cap: a disk filling the cap would end in kills, not
            # ENOSPC, so it is at most DISK_SHARE of the cap, the rest left to the processes.
            cap = int(sandbox.memory_max * DISK_SHARE) if sandbox.memory_max else self.max_disk_bytes
            size = min(self.max_disk_bytes, cap)
            diskfs.mount(str(session_dir), size)
        for path in sandbox.writable_dirs:  # on the sandbox's own filesystem, where it has one
            os.mkdir(path, mode=0o700)
        for path in sandbox.xdg_dirs:
            os.makedirs(path, exist_ok=True)
        user = sandbox._user
        if user is not None:
            # The session directory stays the worker's (so its logs and results do): the sandbox's uid
            # gets the directories its commands write, and reaches them only through its view, where
            # its own passwd and group files name it.
            passwd, group = uidpool.account_files(user.uid, user.gid, sandbox.home)
            for name, text in (("passwd", passwd), ("group", group)):
                (sandbox.files_dir / name).write_text(text, encoding="utf-8")
            identity.give([Path(p) for p in sandbox.writable_dirs], user)
