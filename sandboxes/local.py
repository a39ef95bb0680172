"""The ``local`` sandbox: a private directory tree per session; every command runs under a supervisor.

Layout of one session, ``<root>/<run_id>/<session_id>/``::

    work/         the workspace (``sandbox.workdir``)
    home/         HOME, with the XDG directories under it
    tmp/          TMPDIR
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
import base64
import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import stat
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from sandboxes import diskbound, diskfs, identity, isolation, owner, pidlimit, proctree, uidpool
from sandboxes import supervisor as sup
from sandboxes.base import (
    TAIL_BYTES,
    ExecResult,
    ExecStep,
    SandboxError,
    SandboxLostError,
    SandboxSpec,
    SandboxStartError,
    check_directory_name,
    check_session_names,
)
from sandboxes.environment import (
    SANDBOX_MARKER_VAR,
    base_environment,
    marker_entry,
    merge_environment,
    xdg_dirs,
)
from sandboxes.exec_server import ExecServer, ServedExec, Zygote, ZygoteGone
from sandboxes.inline import inline_if, small_inline, small_tree
from sandboxes.isolation import Choice, IsolationMode
from sandboxes.owner import boot_id, start_ticks
from sandboxes.provider_config import NetworkForward, ProviderConfig
from sandboxes.workspace import baseline_git_dir

log = logging.getLogger(__name__)

DESCRIPTOR_NAME = "sandbox.json"
_REMOVING_SUFFIX = ".removing"  # a stopped sandbox's directory, moved aside until it is deleted
DEFAULT_OUTPUT_CAP_BYTES = 64 * 1024 * 1024
DEFAULT_KILL_GRACE_S = 1.0
DEFAULT_NOFILE_LIMIT = 65_536
DEFAULT_MAX_FILE_MB = 4096
# A runaway of many files stops here, well above a repository with its dependencies installed; the
# watcher's walks are then at most MAX_DELAY_S apart (sandboxes/diskbound.py).
DEFAULT_MAX_DISK_MB = 10240
# A sandbox's memory, its processes' and the files they write to its tmpfs together (a memory cgroup, root
# only), unless its task says (``memory_mb``). Its disk is a tmpfs of max_disk_mb whose pages count here
# too: the tighter bound holds.
DEFAULT_MAX_MEMORY_MB = 8192
DISK_SHARE = 0.75  # of the memory cap, at most, for a sandbox's tmpfs disk (diskfs.py)
SUPERVISOR_SLACK_S = sup.SLACK_S
# Fork servers a provider starts before it starts each sandbox's server as a new interpreter instead.
MAX_ZYGOTE_STARTS = 3
_DISK_DIRS = ("work", "home", "tmp", "baseline.git")  # what a reaper unmounts (diskfs.py)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class Mount(BaseModel):
    """A host path a sandbox's commands see (``sandbox.mounts``): read-only unless ``writable``."""

    model_config = ConfigDict(extra="forbid")

    path: str
    writable: bool = False

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not os.path.isabs(value) or "\0" in value:
            raise ValueError(f"sandbox.mounts: {value!r} is not an absolute path")
        if not os.path.exists(value):
            raise ValueError(f"sandbox.mounts: {value!r} does not exist on this host")
        return os.path.normpath(value)


class LocalSandboxConfig(ProviderConfig):
    provider: Literal["local"] = "local"
    # auto: every layer below this host allows (a network namespace reaching only the gateway, a PID
    # namespace, the filesystem view, the unprivileged user), saying once in one line which it cannot;
    # strict: all of them, or the run does not start; off: the host's network and filesystem and the
    # worker's user, a PID namespace where the host allows. See sandboxes/isolation.py, docs/isolation.md.
    isolation: IsolationMode = "auto"
    # Each layer on its own; unset: as ``isolation`` says. isolated: every command in a loopback-only
    # network namespace of its own, which reaches the gateway (and nothing else) through the gateway's Unix
    # socket (sandboxes/netns.py).
    network: Literal["host", "isolated"] | None = None
    # isolated: a PID namespace per sandbox, so /proc shows only the sandbox's own processes (not the
    # worker's, whose environment holds the API key); auto: isolated when this host allows it.
    pids: Literal["auto", "host", "isolated"] | None = None
    # readonly: the host read-only, homes, /root, /tmp, the run directory and other sandboxes hidden, only
    # the session's own directories writable (sandboxes/fsview.py).
    filesystem: Literal["host", "readonly"] | None = None
    # More paths no sandboxed command may see inside what it sees (the run and sandbox roots, /etc's
    # secrets are hidden already; what is not bound in is not there at all).
    hide: list[str] = Field(default_factory=list)
    # Host paths the filesystem view binds in besides the system directories, the harness cache and the
    # session's own: a path (read-only), or {path, writable}. Everything else of the host is not there.
    mounts: list[Mount] = Field(default_factory=list)
    # Bounds on what one sandbox's commands can take from the host, unset: as ``isolation`` says (off:
    # none). Processes and threads of the whole sandbox (a pids cgroup, root only: sandboxes/pidlimit.py),
    # and the size of any one file a command writes (RLIMIT_FSIZE).
    max_processes: int | None = Field(default=None, gt=0)
    max_file_mb: int | None = Field(default=None, gt=0)
    # The disk a sandbox's files take in total (work, home, tmp), however many: past it, the running
    # command ends as timed out (sandboxes/diskbound.py). Unset: DEFAULT_MAX_DISK_MB (off: no bound).
    max_disk_mb: int | None = Field(default=None, gt=0)
    # A sandbox's memory (a memory cgroup, root only), unless its task says: past it the kernel kills a
    # process of the sandbox, and the command's result says so (``ExecResult.oom_kills``). Unset:
    # DEFAULT_MAX_MEMORY_MB (off: none).
    max_memory_mb: int | None = Field(default=None, gt=0)
    _layers: Choice | None = PrivateAttr(default=None)

    @field_validator("mounts", mode="before")
    @classmethod
    def _path_alone(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"path": item} if isinstance(item, str) else item for item in value]
        return value

    @field_validator("isolation", mode="before")
    @classmethod
    def _off_in_yaml(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _can_isolate(self) -> LocalSandboxConfig:
        try:
            self._layers = isolation.choose(self.isolation, self.network, self.pids, self.filesystem)
        except isolation.IsolationUnavailable as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def layers(self) -> Choice:
        assert self._layers is not None  # set by the validator
        return self._layers

    @property
    def needs_gateway_socket(self) -> bool:
        return self.layers.network

    def build(self, root: Path, network_forward: NetworkForward | None = None) -> LocalSandboxProvider:
        if self.layers.network and network_forward is None:
            raise ValueError("sandbox.network 'isolated' needs the gateway's port and Unix socket")
        layers = self.layers
        return LocalSandboxProvider(
            root,
            keep=self.keep,
            network_forward=network_forward if layers.network else None,
            pids="isolated" if layers.pids else "host",
            filesystem="host" if layers.filesystem == "host" else "readonly",
            user=layers.user,
            hidden=self.hide,
            max_processes=self.max_processes or (None if self.isolation == "off" else pidlimit.DEFAULT_LIMIT),
            max_file_mb=self.max_file_mb or (None if self.isolation == "off" else DEFAULT_MAX_FILE_MB),
            max_disk_mb=self.max_disk_mb or (None if self.isolation == "off" else DEFAULT_MAX_DISK_MB),
            max_memory_mb=self.max_memory_mb or (None if self.isolation == "off" else DEFAULT_MAX_MEMORY_MB),
            mounts=[(m.path, m.writable) for m in self.mounts],
        )

    def reap(self, root: Path, run_id: str | None, *, everything: bool = False) -> list[str]:
        # A local sandbox's owner is a process on this host: a crashed run's owners are all dead.
        return reap_stale(root, run_id)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def _kill_tree(roots: Sequence[int], marker: bytes, *, sweep: bool, grace_s: float) -> bool:
    """Kill the trees under ``roots`` (and, with ``sweep``, every process carrying ``marker``).

    A root counts only if it still carries the marker, so a recycled pid is never mistaken for ours.
    With a grace, the roots (supervisors) are asked first: they end their own trees in order and record
    that they were terminated, which their owner reports as a lost sandbox rather than a crash.
    """
    me = os.getpid()

    def ours(pid: int) -> bool:
        return start_ticks(pid) is not None and proctree.has_env_entry(pid, marker)

    if grace_s > 0 and (supervisors := {pid for pid in roots if ours(pid)}):
        proctree.send(supervisors, signal.SIGTERM)
        proctree.wait_gone(
            lambda: {pid for pid in supervisors if ours(pid)}, grace_s + sup.DRAIN_S, time.sleep
        )

    def find() -> set[int]:
        procs = proctree.snapshot()
        found: set[int] = set()
        for root in roots:
            if root in procs and procs[root].alive and proctree.has_env_entry(root, marker):
                found |= {root} | proctree.descendants(procs, root)
        if sweep:
            found |= {
                pid for pid, info in procs.items() if info.alive and proctree.has_env_entry(pid, marker)
            }
        found.discard(me)
        return {pid for pid in found if pid in procs and procs[pid].alive}

    return proctree.kill_processes(find, grace_s=grace_s, idle=time.sleep)


def _file_tail(path: Path) -> tuple[int, bytes]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - TAIL_BYTES))
            return size, f.read(TAIL_BYTES)
    except OSError:
        return 0, b""


def _text(data: bytes) -> str:
    return data[-TAIL_BYTES:].decode("utf-8", errors="replace")


@dataclass(frozen=True)
class _ExecFiles:
    stdout: Path
    stderr: Path
    result: Path
    log: Path
    stdin: Path


class LocalSandboxProvider:
    """Starts local sandboxes under ``root``. ``keep=False`` removes a session's directory at stop."""

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
        # The fork server of supervisor servers (sandboxes/zygote.py), started with the first sandbox.
        self._zygote: Zygote | None = None
        self._zygote_starts = 0
        # A spare starts at the lowest CPU priority while the machine may need the CPU for a harness, and
        # gets the normal one back when taken; False once this process turns out not to be allowed to.
        self._spare_nice = True
        self._removals: set[asyncio.Task[None]] = set()
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

        def lay_out() -> None:
            if not server.cgroups:  # a spare's are made and joined while the sandbox before it ran
                server.cgroups = self._cap(server)
            sandbox.pids_cgroup = server.cgroups.get(pidlimit.PIDS)
            sandbox.memory_cgroup = server.cgroups.get(pidlimit.MEMORY)
            if sandbox.memory_cgroup and sandbox.memory_max != self.max_memory_bytes:  # the task's own
                assert sandbox.memory_max
                pidlimit.set_limit(sandbox.memory_cgroup, sandbox.memory_max, pidlimit.MEMORY)
            self._make_tree(session_dir, sandbox)
            sandbox._write_descriptor(create=True)

        # A dozen mkdirs, chowns and creates, each of which can wait milliseconds on a busy disk: not on
        # the event loop, which a worker's hundred other sessions share.
        laying = asyncio.ensure_future(asyncio.to_thread(lay_out))
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
        return sandbox

    async def _take_server(self) -> ExecServer:
        """The spare supervisor server if there is a live one, else a new one. A server's interpreter
        start-up and imports take tens of milliseconds, which a spare moves off the session's path."""
        loop = asyncio.get_running_loop()
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
        runs, so that its start-up neither delays a session's setup on this event loop nor takes the
        CPU from a harness (it runs at the lowest priority until taken)."""
        loop = asyncio.get_running_loop()
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
        A server that could not be moved leaves each init to join the caps itself (slower, as capped)."""
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

    async def _discard(self, server: ExecServer, timeout: float) -> None:
        """End a server no sandbox took, and the cap made for it."""
        await server.close(timeout)
        for group in server.cgroups.values():
            await asyncio.to_thread(pidlimit.remove, group, 2.0)

    async def _new_server(self) -> ExecServer:
        token = uuid.uuid4().hex
        # Not yet any sandbox's: it runs from / and carries only its marker, which the sandbox adopts.
        options: dict[str, Any] = {
            "env": {SANDBOX_MARKER_VAR: token},
            "marker_token": token,
            "log_path": self._server_log,
            "pid_namespace": isolation.server_pid_namespace(self.isolation),
            "network_forward": isolation.server_network(self.isolation),
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
        """End the spare supervisor server, if any, and finish removing stopped sandboxes' directories.
        Sandboxes still running are not affected."""
        spare, self._spare = self._spare, None
        if spare is not None and spare[0] is asyncio.get_running_loop():
            with contextlib.suppress(Exception):
                await self._discard(await spare[1], self.kill_grace_s)
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            await zygote.close()
        await self.finish_removals()

    async def finish_removals(self) -> None:
        """Wait for the deletions of stopped sandboxes' directories begun so far."""
        await asyncio.gather(*self._removals, return_exceptions=True)

    def _remove_later(self, session_dir: Path, owner_name: str) -> None:
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

    def _make_tree(self, session_dir: Path, sandbox: LocalSandbox) -> None:
        session_dir.parent.mkdir(parents=True, exist_ok=True)
        session_dir.mkdir(mode=0o700)
        for sub in ("work", "home", "tmp", "logs", "run"):
            (session_dir / sub).mkdir(mode=0o700)
        for path in sandbox.writable_dirs:
            os.makedirs(path, mode=0o700, exist_ok=True)
        if self.disk_fs:
            assert self.max_disk_bytes
            # Its pages count toward the memory cap: a disk filling the cap would end in kills, not
            # ENOSPC, so it is at most DISK_SHARE of the cap, the rest left to the processes.
            cap = int(sandbox.memory_max * DISK_SHARE) if sandbox.memory_max else self.max_disk_bytes
            size = min(self.max_disk_bytes, cap)
            diskfs.mount(str(session_dir), sandbox.writable_dirs, size)
        for path in sandbox.xdg_dirs:
            os.makedirs(path, exist_ok=True)
        user = sandbox._user
        if user is not None:
            # The session directory stays the worker's (so its logs and results do): the sandbox's uid
            # gets the directories its commands write, and reaches them only through its view, where
            # its own passwd and group files name it.
            passwd, group = uidpool.account_files(user.uid, user.gid, sandbox.home)
            for name, text in (("passwd", passwd), ("group", group)):
                (session_dir / name).write_text(text, encoding="utf-8")
            identity.give([Path(p) for p in sandbox.writable_dirs], user)


class LocalSandbox:
    """One session's sandbox on this host. Build it with ``LocalSandboxProvider.start``."""

    runs_before = True  # see sandboxes.base.RunsBefore
    # sandboxes.base.Sandbox's optional parts: none of its own (its provider's label, the worker's URL).
    isolation_label = gateway_url = check_runs = None

    def __init__(
        self,
        provider: LocalSandboxProvider,
        spec: SandboxSpec,
        session_dir: Path,
        server: ExecServer,
        owner_name: str,
        lease: uidpool.Lease | None = None,
    ) -> None:
        self.provider_name = provider.name
        self.spec = spec
        self.id = f"local-{spec.session_id}"
        self.root = session_dir
        self.workdir = str(session_dir / "work")
        self.home = str(session_dir / "home")
        self.tmpdir = str(session_dir / "tmp")
        self._logs = session_dir / "logs"
        self._run = session_dir / "run"
        self._keep = provider.keep
        self._provider = provider
        self._cap = provider.output_cap_bytes
        self._grace = provider.kill_grace_s
        self._nofile = provider.nofile_limit
        self._slack = provider.supervisor_slack_s
        self._isolation = provider.isolation
        self._lease = lease  # its uid, no other running sandbox's (uidpool.py)
        self._user = identity.Identity(lease.uid, lease.gid) if lease is not None else None
        # The directories commands may write; under a filesystem view, all they see of the session. The
        # baseline's git directory (sandboxes/workspace.py) is made here, as the view cannot bind what
        # does not exist yet.
        self.writable_dirs = [self.workdir, self.home, self.tmpdir]
        if provider.isolation.filesystem != "host":
            self.writable_dirs.append(baseline_git_dir(self.workdir))
        files = None
        if self._user is not None:  # programs that look their user up find the sandbox's uid
            files = {"/etc/passwd": str(session_dir / "passwd"), "/etc/group": str(session_dir / "group")}
        self._view = isolation.view(
            provider.isolation, self.writable_dirs, provider.hidden, provider.mounts, files
        )
        # The server was started before this sandbox existed; its marker becomes the sandbox's.
        self._server = server
        self._marker_token = server.marker_token
        self._marker = marker_entry(self._marker_token)
        self.pids_cgroup: str | None = None  # its process cap's cgroup.procs, where the host has one
        self.memory_cgroup: str | None = None  # its memory cap's, likewise
        memory_mb = spec.memory_limit_mb
        self.memory_max = memory_mb * 1024 * 1024 if memory_mb else provider.max_memory_bytes
        base = base_environment(
            home=self.home,
            tmpdir=self.tmpdir,
            marker_token=self._marker_token,
            path_prefixes=provider.path_prefixes,
        )
        self.xdg_dirs = xdg_dirs(base)  # always under home, whatever spec.env says
        self.base_env = merge_environment(base, spec.env)
        self.created_at = time.time()
        self.ttl_deadline = self.created_at + spec.ttl_s
        self._owner = owner_name
        self._owner_pid = os.getpid()
        self._owner_start_ticks = start_ticks(self._owner_pid)
        self._host = socket.gethostname()
        self._boot_id = boot_id()
        self._running: dict[int, ServedExec] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        self._name_counts: dict[str, int] = {}
        self._stopping = False
        self._stopped = False
        self._reaped = False
        self._stop_lock = asyncio.Lock()

    # -- descriptor -------------------------------------------------------------------------------------

    def descriptor(self) -> dict[str, Any]:
        return {
            "provider": self.provider_name,
            "id": self.id,
            "run_id": self.spec.run_id,
            "session_id": self.spec.session_id,
            "root": str(self.root),
            "workdir": self.workdir,
            "home": self.home,
            "created_at": self.created_at,
            "ttl_deadline": self.ttl_deadline,
            "owner": self._owner,
            "owner_pid": self._owner_pid,
            "owner_start_ticks": self._owner_start_ticks,
            "host": self._host,
            "boot_id": self._boot_id,
            "marker": self._marker_token,
            "server_pid": self._server.pid,
            "pids_cgroup": self.pids_cgroup,
            "memory_cgroup": self.memory_cgroup,
            "disk_fs": self._provider.disk_fs,
            "uid": self._user.uid if self._user is not None else None,
            # Whether the directory outlives the sandbox: a reaper removes a dead owner's unless kept.
            "keep": self._keep,
            # Live in memory only: on disk the server is the root, and every supervisor is its child.
            "supervisor_pids": sorted(self._running),
        }

    @property
    def descriptor_path(self) -> Path:
        return self.root / DESCRIPTOR_NAME

    def _write_descriptor(self, *, create: bool = False) -> None:
        # Once stopping, the descriptor is being removed; an exec finishing late must not bring it back.
        if self._stopping or self._reaped:
            return
        if not create and not self.descriptor_path.exists():
            self._reaped = True  # reap_stale took this sandbox (its TTL passed): it is gone for good
            return
        _write_json_atomic(self.descriptor_path, self.descriptor())

    @property
    def owner_ids(self) -> tuple[int, int] | None:
        """The (uid, gid) its commands run as and its writable files belong to; None: the worker's."""
        return (self._user.uid, self._user.gid) if self._user is not None else None

    # -- paths ------------------------------------------------------------------------------------------

    def _inside(self, path: str) -> Path:
        return confined_path(str(self.root), self.workdir, path, f"sandbox {self.id}")

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._check_open()
        where = f"sandbox {self.id}"
        try:
            await small_inline(
                len(data), write_confined, str(self.root), self.workdir, path, data, mode, where, self._user
            )
        except SandboxError:
            raise
        except OSError as exc:
            raise SandboxError(f"cannot write {path!r} in sandbox {self.id}: {exc}") from exc

    async def read_file(self, path: str, limit: int) -> bytes:
        """At most ``limit`` bytes from the start of a regular file. A missing file: FileNotFoundError."""
        if limit < 0:
            raise SandboxError(f"negative read limit {limit}")

        def read(real: Path) -> bytes:
            # O_NONBLOCK so that a FIFO planted at this path cannot hang us in open().
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise SandboxError(f"{path!r} in sandbox {self.id} is not a regular file")
                return f.read(limit)

        try:
            real = self._inside(path)
            try:
                size = min(limit, os.stat(real).st_size)
            except FileNotFoundError:
                raise
            except OSError:
                size = limit  # read() says what is wrong
            return await small_inline(size, read, real)
        except (SandboxError, FileNotFoundError):
            raise
        except OSError as exc:
            raise SandboxError(f"cannot read {path!r} in sandbox {self.id}: {exc}") from exc

    async def copy_in(self, src: Path, dest: str | None = None) -> None:
        """Copy a local directory's content into the workspace, or into ``dest`` (a path in the sandbox),
        symlinks kept as links, .git included."""
        self._check_open()
        src = Path(src)
        if not src.is_dir():
            raise SandboxError(f"cannot copy {src} into sandbox {self.id}: not a directory")
        target = self.workdir if dest is None else str(self._inside(dest))
        try:
            await inline_if(small_tree(src), self._copy_tree, src, target)
        except (OSError, shutil.Error) as exc:
            raise SandboxError(f"cannot copy {src} into sandbox {self.id}: {str(exc)[:2000]}") from exc

    def _copy_tree(self, src: Path, target: str) -> None:
        os.makedirs(target, exist_ok=True)
        copy_tree(str(src), target, self._user)
        _copy_dir_stat(os.stat(src), target, self._user)

    # -- exec -------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._stopping:
            raise SandboxError(f"sandbox {self.id} is stopped")
        if self._reaped or not self.descriptor_path.exists():
            self._reaped = True
            raise SandboxLostError(f"sandbox {self.id} was reaped")

    def _reserve(self, name: str) -> _ExecFiles:
        """Claim log file names for one exec; a repeated name gets a numbered suffix, nothing is reused."""
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise SandboxError(f"invalid exec name {name!r}")
        for _ in range(10_000):
            n = self._name_counts[name] = self._name_counts.get(name, 0) + 1
            stem = name if n == 1 else f"{name}.{n}"
            stdout = self._logs / f"{stem}.stdout"
            try:
                os.close(os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
            except FileExistsError:
                continue
            stderr = self._logs / f"{stem}.stderr"
            os.close(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644))
            run = self._run / stem
            return _ExecFiles(
                stdout=stdout,
                stderr=stderr,
                result=run.with_name(f"{stem}.result.json"),
                # One for the sandbox, appended to: supervisors rarely write, and on a busy disk each file
                # made costs the kernel a search for a free inode.
                log=self._run / "supervisors.log",
                stdin=run.with_name(f"{stem}.stdin"),
            )
        raise SandboxError(f"no free log name for exec {name!r}")

    async def exec(
        self,
        argv: list[str],
        *,
        timeout: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        name: str = "exec",
        before: ExecStep | None = None,
        expire: asyncio.Event | None = None,
    ) -> ExecResult:
        """Run ``argv`` (no shell) to its end, its timeout or the TTL; no process of it outlives this call.

        ``stdout_bytes``/``stderr_bytes`` count everything the command wrote; the files keep the first
        ``output_cap_bytes`` of it and the tails are the last bytes written, not of the file. Raises
        SandboxLostError when the sandbox is stopped or reaped while the command runs. ``before``: a step
        run to its end first, under the same supervisor, its result in the result's ``before``. ``expire``:
        once set, the command ends as if its timeout had passed (its result says timed out).
        """
        self._check_open()
        if time.time() >= self.ttl_deadline:
            raise SandboxError(f"sandbox {self.id} is past its TTL")
        if not argv or not all(isinstance(a, str) for a in argv):
            raise SandboxError(f"argv must be a non-empty list of strings, not {argv!r}")
        for bound in [timeout] + ([before.timeout] if before else []):
            if not (isinstance(bound, int | float) and bound > 0 and math.isfinite(bound)):
                raise SandboxError(f"invalid timeout {bound!r}")
        if before is not None and not before.argv:
            raise SandboxError("a before step's argv must not be empty")
        # A realpath and, below, a small JSON file on the sandbox's local disk: microseconds, where a hop
        # to a thread and back costs about half a millisecond an exec on a busy worker.
        cwd_real = self._inside(cwd or self.workdir)
        if not cwd_real.is_dir():
            raise SandboxError(f"working directory {cwd!r} is not a directory in sandbox {self.id}")
        exec_env = merge_environment(self.base_env, env)
        files = self._reserve(name)
        if stdin is not None:
            await asyncio.to_thread(files.stdin.write_bytes, stdin)
        memory_mb = self.spec.memory_limit_mb
        argv = isolation.wrap(argv, self._isolation, self._view)
        params = {
            "argv": argv,
            "cwd": str(cwd_real),
            "stdout_path": str(files.stdout),
            "stderr_path": str(files.stderr),
            "stdin_path": str(files.stdin) if stdin is not None else None,
            "result_path": str(files.result),
            "timeout_s": float(timeout),
            "deadline_epoch": self.ttl_deadline,
            "parent_pid": os.getpid(),
            "output_cap_bytes": self._cap,
            "tail_bytes": TAIL_BYTES,
            "kill_grace_s": self._grace,
            "nofile_limit": self._nofile,
            # An address-space limit only where no memory cgroup caps the whole sandbox: it breaks the
            # runtimes that reserve address space they never use (V8, Go, the JVM).
            "memory_limit_bytes": memory_mb * 1024 * 1024 if memory_mb and not self.memory_cgroup else None,
            "log_path": str(files.log),
            **isolation.supervisor_params(self._isolation, self._view, self._user),
            "uid_busy": self._lease.busy_path if self._lease is not None else None,
            "cgroup_procs": self.pids_cgroup,
            "pids_max": self._provider.max_processes,
            "memory_procs": self.memory_cgroup,
            "memory_max": self.memory_max,
            "file_size_limit_bytes": self._provider.max_file_bytes,
        }
        before_files = None
        if before is not None:
            before_files = self._reserve(before.name)
            # The step's environment goes through the server's pipe with the rest, never to disk.
            params["before"] = {
                "argv": isolation.wrap(before.argv, self._isolation, self._view),
                "timeout_s": float(before.timeout),
                "stdout_path": str(before_files.stdout),
                "stderr_path": str(before_files.stderr),
                "env": merge_environment(exec_env, before.env),
            }
            timeout += before.timeout

        started = time.monotonic()
        oom_before = pidlimit.oom_kills(self.memory_cgroup)
        disk = None
        if (
            self._provider.max_disk_bytes and not self._provider.disk_fs
        ):  # its expiry ends the command as the caller's would
            disk = diskbound.DiskWatch(self.writable_dirs, self._provider.max_disk_bytes, expire)
            expire = disk.expired
        # The command's environment goes through the server's pipe, never to disk.
        proc = await self._server.spawn(params, exec_env)
        self._running[proc.pid] = proc
        self._provider.want_spare()
        try:
            if self._stopping:  # stop() ran while we were spawning and did not see this supervisor
                self._signal(proc, signal.SIGTERM)
            killed_from_outside = await self._wait_supervisor(proc, timeout, expire)
        except asyncio.CancelledError:
            cleanup = asyncio.ensure_future(self._end_supervisor(proc))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(cleanup)
            raise
        finally:
            self._running.pop(proc.pid, None)
            files.stdin.unlink(missing_ok=True)
            if disk is not None:
                await disk.stop()
        result = await self._collect(
            files, name, proc, killed_from_outside, time.monotonic() - started, before_files
        )
        if disk is not None and disk.why is not None and result.timed_out:
            result.limit = disk.why
        result.oom_kills = pidlimit.oom_kills(self.memory_cgroup) - oom_before
        if result.oom_kills and result.exit_code != 0 and not result.timed_out:
            # It failed, and the kernel killed a process of it for the cap meanwhile: a kill by the cap
            # (SIGKILL, or 137 from a shell between), not a signal sent from inside the sandbox.
            assert self.memory_max
            result.limit = (
                f"the sandbox's memory cap of {self.memory_max // 2**20} MiB killed "
                f"{result.oom_kills} of its processes (out of memory)"
            )
        return result

    @staticmethod
    def _signal(proc: ServedExec, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)

    async def _wait_supervisor(self, proc: ServedExec, timeout: float, expire: asyncio.Event | None) -> bool:
        """Wait for the supervisor; past its own bound, kill its tree from here. True if we had to."""
        ttl_left = max(0.0, self.ttl_deadline - time.time())
        budget = min(timeout, ttl_left) + self._grace + self._slack
        ended = asyncio.ensure_future(proc.wait())
        if expire is not None:
            expired = asyncio.ensure_future(expire.wait())
            try:
                await asyncio.wait({ended, expired}, timeout=budget, return_when=asyncio.FIRST_COMPLETED)
            finally:
                expired.cancel()
            if not ended.done() and expire.is_set():
                self._signal(proc, sup.EXPIRE_SIGNAL)
                budget = self._grace + self._slack  # for the supervisor to end the command's tree
            elif not ended.done():
                budget = 0.0  # the bound above has passed already
        try:
            await asyncio.wait_for(ended, budget)
            return False
        except TimeoutError:
            log.warning("sandbox %s: supervisor %d overran; killing its tree", self.id, proc.pid)
            await asyncio.to_thread(_kill_tree, [proc.pid], self._marker, sweep=False, grace_s=0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), self._slack)
            return True

    async def _end_supervisor(self, proc: ServedExec) -> None:
        """Ask a supervisor to kill its tree and exit; force it if it does not, bounded either way."""
        self._signal(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self._grace + self._slack)
        except TimeoutError:
            await asyncio.to_thread(_kill_tree, [proc.pid], self._marker, sweep=False, grace_s=0)

    async def _collect(
        self,
        files: _ExecFiles,
        name: str,
        proc: ServedExec,
        killed: bool,
        duration: float,
        before_files: _ExecFiles | None = None,
    ) -> ExecResult:
        try:
            res: dict[str, Any] | None = json.loads(files.result.read_text())
        except (OSError, ValueError):
            res = None
        if res is None:
            if killed and not self._stopping:
                (out_n, out), (err_n, err) = _file_tail(files.stdout), _file_tail(files.stderr)
                return ExecResult(
                    exit_code=None,
                    signal=signal.SIGKILL,
                    timed_out=True,
                    duration_s=duration,
                    stdout_tail=_text(out),
                    stderr_tail=_text(err),
                    stdout_bytes=out_n,
                    stderr_bytes=err_n,
                    stdout_path=str(files.stdout),
                    stderr_path=str(files.stderr),
                )
            _n, sup_log = _file_tail(files.log)
            raise SandboxLostError(
                f"sandbox {self.id}: supervisor of {name!r} ended (status {proc.returncode}) without a "
                f"result: {_text(sup_log)[-2000:]}"
            )
        if res.get("error"):
            raise SandboxError(f"sandbox {self.id}: exec {name!r} failed: {str(res['error'])[:2000]}")
        if res["reason"] == "terminated":
            raise SandboxLostError(f"sandbox {self.id} was stopped while {name!r} was running")
        if not res.get("clean", True):
            log.warning("sandbox %s: processes of %r outlived their supervisor; stop() sweeps", self.id, name)
        before = None
        if before_files is not None and isinstance(res.get("before"), dict):
            before = _exec_result(res["before"], before_files, float(res["before"].get("duration_s", 0.0)))
        return _exec_result(res, files, duration, before)

    # -- end of life ------------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Kill everything still running, remove the descriptor; idempotent. Keeps the directory unless
        the provider was made with ``keep=False``. Raises SandboxError if processes could not be ended."""
        async with self._stop_lock:
            if self._stopped:
                return
            self._stopping = True
            procs = list(self._running.values())
            for proc in procs:
                self._signal(proc, signal.SIGTERM)
            waits = [asyncio.ensure_future(p.wait()) for p in procs] + list(self._cleanups)
            if waits:
                _done, pending = await asyncio.wait(waits, timeout=self._grace + sup.DRAIN_S + 2.0)
                for task in pending:
                    if task not in self._cleanups:
                        task.cancel()
            # Whatever did not go by itself, and anything of ours that escaped every tree: by force.
            overran = [p.pid for p in procs if not p.ended]
            await self._server.close(self._grace + sup.DRAIN_S + 2.0)
            clean = not overran and self._server.emptied_its_namespace
            if not clean:  # a walk of all of /proc for our marker: milliseconds, needed only here
                overran.append(self._server.pid)
                clean = await asyncio.to_thread(_kill_tree, overran, self._marker, sweep=True, grace_s=0)
            if not clean:
                raise SandboxError(f"sandbox {self.id}: processes still alive after stop")
            for group in (self.pids_cgroup, self.memory_cgroup):
                if not pidlimit.remove(group):  # its last process may not be released yet
                    await asyncio.to_thread(pidlimit.remove, group, 2.0)
            await asyncio.to_thread(self._unmount_disk)
            if self._lease is not None:  # its processes are gone: the uid is free for another sandbox
                self._lease.release()
            self.descriptor_path.unlink(missing_ok=True)
            if not self._keep:
                self._provider._remove_later(self.root, self._owner)
            self._stopped = True

    def _unmount_disk(self) -> None:
        if self._provider.disk_fs:
            diskfs.unmount(str(self.root), self.writable_dirs, self._keep_files if self._keep else None)

    def _keep_files(self, src: str, dst: str) -> None:
        """A kept session's files, copied off its tmpfs before it goes (links as links)."""
        try:
            copy_tree(src, dst, self._user)
        except OSError as exc:  # a FIFO or socket the agent made: what is copied stays
            log.warning("sandbox %s: kept files of %s in part: %s", self.id, dst, str(exc)[:500])

    async def delete(self) -> None:
        """Stop, then remove the session's directory whatever ``keep`` says."""
        await self.stop()
        await asyncio.to_thread(shutil.rmtree, self.root, ignore_errors=True)


def _exec_result(
    res: dict[str, Any], files: _ExecFiles, duration: float, before: ExecResult | None = None
) -> ExecResult:
    """The ExecResult of a supervisor's result for one command (or one step)."""
    return ExecResult(
        exit_code=res["exit_code"],
        signal=res["signal"],
        timed_out=bool(res["timed_out"]),
        duration_s=duration,
        stdout_tail=_text(base64.b64decode(res.get("stdout_tail_b64", ""))),
        stderr_tail=_text(base64.b64decode(res.get("stderr_tail_b64", ""))),
        stdout_bytes=int(res.get("stdout_bytes", 0)),
        stderr_bytes=int(res.get("stderr_bytes", 0)),
        stdout_path=str(files.stdout),
        stderr_path=str(files.stderr),
        before=before,
    )


def confined_path(root: str, base: str, path: str, where: str) -> Path:
    """The real path of ``path`` (relative to ``base``, or absolute), refused if it resolves outside
    ``root`` (a real path); ``where`` names ``root`` in the error.

    A process in the sandbox could still swap a directory for a symlink between this check and the
    open; the final component is opened with O_NOFOLLOW, which narrows that to parent directories.
    """
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxError(f"invalid sandbox path {path!r}")
    candidate = path if os.path.isabs(path) else os.path.join(base, path)
    real = os.path.realpath(candidate)
    if os.path.commonpath([real, root]) != root:
        raise SandboxError(f"path {path!r} resolves outside {where}")
    return Path(real)


def write_confined(
    root: str,
    base: str,
    path: str,
    data: bytes,
    mode: int,
    where: str,
    owner: identity.Identity | None = None,
) -> None:
    """Write ``data`` at ``path`` as ``confined_path`` resolves it, making its directories; blocking.
    With ``owner``, the file and the directories made for it are the owner's."""
    real = confined_path(root, base, path, where)
    made = [p for p in (real.parent, *real.parent.parents) if not p.exists()]
    real.parent.mkdir(parents=True, exist_ok=True)
    confined_path(root, base, str(real.parent), where)  # the directories just made must still be inside
    fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        os.fchmod(f.fileno(), mode)  # the umask must not change what the caller asked for
        if owner is not None:
            os.fchown(f.fileno(), owner.uid, owner.gid)
    if owner is not None:
        for directory in made:
            os.lchown(directory, owner.uid, owner.gid)


def copy_tree(src: str, dst: str, owner: identity.Identity | None = None) -> None:
    """Copy what directory ``src`` holds into the existing directory ``dst``: regular files with their
    mode and times, symlinks as links, directories with their mode and times; with ``owner``, all it
    makes is the owner's. Anything else (a FIFO, a device), or a symlink where a directory or file is to
    be made, is an OSError. Blocking.

    Unlike ``shutil.copytree`` + ``identity.give``: one pass, and per file only its open, copy, chmod,
    chown and utime (no second stat, no extended attributes, no walk to chown): a prepared workspace is
    copied into every sandbox, so each call here is a system call of every rollout."""
    with os.scandir(src) as entries:
        for entry in entries:
            target = os.path.join(dst, entry.name)
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), target)
                if owner is not None:
                    os.lchown(target, owner.uid, owner.gid)
            elif entry.is_dir(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                try:
                    os.mkdir(target, 0o700)
                except FileExistsError:
                    if not stat.S_ISDIR(os.lstat(target).st_mode):
                        raise
                copy_tree(entry.path, target, owner)
                _copy_dir_stat(st, target, owner)
            elif entry.is_file(follow_symlinks=False):
                _copy_file(entry.path, target, owner)
            else:
                raise OSError(f"{entry.path}: not a regular file, directory or symlink")


def _copy_dir_stat(st: os.stat_result, target: str, owner: identity.Identity | None) -> None:
    os.chmod(target, stat.S_IMODE(st.st_mode))
    if owner is not None:
        os.lchown(target, owner.uid, owner.gid)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_file(src: str, dst: str, owner: identity.Identity | None) -> None:
    fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fin)
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            offset = 0
            while offset < st.st_size and (sent := os.sendfile(fout, fin, offset, st.st_size - offset)):
                offset += sent
            os.fchmod(fout, stat.S_IMODE(st.st_mode))
            if owner is not None:  # after the chmod, so that it clears set-user-ID bits as before
                os.fchown(fout, owner.uid, owner.gid)
            os.utime(fout, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def reap_stale(
    root: Path, run_id: str | None = None, *, now: float | None = None, grace_s: float = DEFAULT_KILL_GRACE_S
) -> list[str]:
    """Kill the processes of local sandboxes under ``root`` whose owner is dead or whose TTL has passed,
    and remove their descriptors; a dead owner's sandbox directory goes too, unless its provider kept
    directories (``keep``). Returns the ids reaped; idempotent. Blocking: call it in a thread from async
    code. Sandboxes of other machines are left to their own.

    An owner is dead when its record's lock is free (sandboxes/owner.py): a pid would not do, since the
    reaper may see another PID namespace than the owner did. Processes are found by the sandbox's marker
    in this reaper's /proc; a dead owner's processes in a namespace it cannot see are not its to kill."""
    root = Path(root)
    if run_id is not None:
        check_directory_name("run_id", run_id)
    pattern = f"{run_id}/*/{DESCRIPTOR_NAME}" if run_id else f"*/*/{DESCRIPTOR_NAME}"
    now = time.time() if now is None else now
    host, boot = socket.gethostname(), boot_id()
    reaped: list[str] = []
    for path in sorted(root.glob(pattern)):
        try:
            desc = json.loads(path.read_text(encoding="utf-8"))
            sandbox_id, marker = str(desc["id"]), marker_entry(str(desc["marker"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if desc.get("boot_id") == boot:  # this machine since its last boot: its processes may run
            # A sandbox without an owner record (an older version's) has only its TTL to end it.
            name = desc.get("owner")
            owner_dead = isinstance(name, str) and owner.known_dead(root, name)
            if not owner_dead and now < float(desc["ttl_deadline"]):
                continue
            roots = [int(pid) for pid in desc.get("supervisor_pids", [])]
            if desc.get("server_pid"):
                roots.append(int(desc["server_pid"]))
            if not _kill_tree(roots, marker, sweep=True, grace_s=grace_s):
                log.warning("reap_stale: processes of %s survived; leaving its descriptor", sandbox_id)
                continue
            pidlimit.remove(desc.get("pids_cgroup"), 2.0)
            pidlimit.remove(desc.get("memory_cgroup"), 2.0)
            if desc.get("disk_fs"):
                with contextlib.suppress(OSError):
                    diskfs.unmount(str(path.parent), [str(path.parent / sub) for sub in _DISK_DIRS])
        elif desc.get("host") != host:
            continue  # another machine's
        else:
            owner_dead = True  # this host before its last boot: its owner died with it
        path.unlink(missing_ok=True)
        # A live owner whose TTL passed still collects from the directory, and removes it at its stop.
        if owner_dead and not desc.get("keep"):
            shutil.rmtree(path.parent, ignore_errors=True)
        reaped.append(sandbox_id)
    # Directories whose deletion a worker began but did not live to finish; nothing runs in them.
    for aside in root.glob(f"{run_id or '*'}/*{_REMOVING_SUFFIX}"):
        if aside.is_dir() and not (aside / DESCRIPTOR_NAME).exists() and _remover_gone(root, aside.name):
            shutil.rmtree(aside, ignore_errors=True)
    return reaped


def _remover_gone(root: Path, aside: str) -> bool:
    name = aside.removesuffix(_REMOVING_SUFFIX).rpartition(".")[2]
    # An aside named after its session alone is an older version's: nobody is deleting it any more.
    return not owner.is_owner_name(name) or owner.known_dead(root, name)
