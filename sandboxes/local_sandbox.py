"""One local sandbox (``LocalSandbox``, built by ``LocalSandboxProvider.start`` in sandboxes/local.py): its
descriptor, its files, its commands run under the supervisor server, and its stop."""

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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sandboxes import diskbound, diskfs, identity, isolation, pidlimit, uidpool
from sandboxes import supervisor as sup
from sandboxes.base import (
    TAIL_BYTES,
    ExecResult,
    ExecStep,
    SandboxError,
    SandboxLostError,
    SandboxSpec,
)
from sandboxes.carry import clear_paths
from sandboxes.environment import (
    base_environment,
    marker_entry,
    merge_environment,
    xdg_dirs,
)
from sandboxes.exec_server import ExecServer, ServedExec
from sandboxes.inline import inline_if, small_inline, small_tree
from sandboxes.local_files import _copy_dir_stat, confined_path, copy_tree, write_confined
from sandboxes.local_reap import DESCRIPTOR_NAME, _kill_tree
from sandboxes.owner import boot_id, own_start_ticks
from sandboxes.workspace import baseline_git_dir


class SandboxOwner(Protocol):
    """What a local sandbox asks of the provider that started it (``LocalSandboxProvider``)."""

    disk_fs: bool
    max_processes: int | None
    max_file_bytes: int | None
    max_disk_bytes: int | None

    def want_spare(self) -> None: ...

    def keep_caps(self, groups: dict[str, str]) -> bool: ...

    def may_hand_on(self, server: ExecServer) -> bool: ...

    def reclaim(self, server: ExecServer, marker_token: str) -> bool: ...

    async def keep_server(self, server: ExecServer, *, usable: bool) -> None: ...

    def remove_later(self, session_dir: Path, owner_name: str) -> None: ...

    def finish_at_close(self, task: asyncio.Task[None]) -> None: ...


# The provider's logger, whichever of its modules logs.
log = logging.getLogger("sandboxes.local")


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


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


class LocalSandbox:
    """One session's sandbox on this host. Build it with ``LocalSandboxProvider.start``."""

    runs_before = True  # see sandboxes.base.RunsBefore
    stops_on_event = True  # see sandboxes.base.StopsOnEvent
    # sandboxes.base.Sandbox's optional parts: none of its own (its provider's label, the worker's URL,
    # the host's python3).
    isolation_label = gateway_url = check_runs = python_argv = None
    shares_host_userland = True

    def __init__(
        self,
        provider: SandboxOwner,
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
        # What its commands write, and its user's passwd and group: on its own filesystem where it has
        # one (diskfs.py), else in the session directory itself.
        self.files_dir = session_dir / diskfs.DISK_DIR if provider.disk_fs else session_dir
        self.files_in_memory = provider.disk_fs  # its own tmpfs: no call on them waits on a disk
        self.workdir = str(self.files_dir / "work")
        self.home = str(self.files_dir / "home")
        self.tmpdir = str(self.files_dir / "tmp")
        self._logs = session_dir / "logs"
        self.session_fs = False  # the session directory a tmpfs of its own (diskfs.py): set at its start
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
            files = {f"/etc/{name}": str(self.files_dir / name) for name in ("passwd", "group")}
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
        self._owner_start_ticks = own_start_ticks()
        self._host = socket.gethostname()
        self._boot_id = boot_id()
        self._running: dict[int, ServedExec] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        self._name_counts: dict[str, int] = {}
        self._stopping = False
        self._stopped = False
        # Its commands ended before its stop (``end_commands``): its server is no longer its own, and
        # with ``_handed_early`` serves another sandbox.
        self._ended = False
        self._handed_early = False
        self._handed_with = ""  # the marker its server was handed on with (``end_commands``)
        self._reaped = False
        self._stop_lock = asyncio.Lock()
        self._stop_task: asyncio.Task[None] | None = None

    def prepare_view(self) -> None:
        """Start the build of the filesystem view that every command of this sandbox joins (root's view:
        supervisor_server.py), now that the directories it binds are made: it then overlaps the rest of
        the sandbox's set-up (or, for a grading sandbox started beside the harness, the harness) instead
        of delaying the first command."""
        view = isolation.supervisor_params(self._isolation, self._view, self._user).get("view")
        if view:
            self._server.prepare_view(view)

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
            "session_fs": self.session_fs,
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

    async def clear_paths(self, paths: list[str]) -> None:
        """Room in the workspace for a file at each of ``paths`` (relative, checked): what is at each,
        and any ancestor of it that is a link or not a directory, removed (``carry.clear_paths``),
        by the worker on this host: no command of the sandbox's, whose exec costs ~5 ms of the machine's
        CPU. For a grading sandbox, where nothing of the agent's ever ran."""
        self._check_open()
        try:
            await asyncio.to_thread(clear_paths, self.workdir, paths)  # a tree there may be large
        except OSError as exc:
            raise SandboxError(f"cannot clear paths in sandbox {self.id}: {exc}") from exc

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
        if self._ended:
            raise SandboxError(f"sandbox {self.id}: its commands have ended")
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
            assert self.memory_max
            result.limit = pidlimit.killed_by_cap(self.memory_max, result.oom_kills)
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
            if self._stopping:  # its stop may have taken the result away with the sandbox's directory
                raise SandboxLostError(f"sandbox {self.id} was stopped while {name!r} was running")
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
        the provider was made with ``keep=False``. Raises SandboxError if processes could not be ended.

        Once begun, the stop runs to its end whoever waits for it: a caller that stops waiting (its bound
        passed, its session was cancelled) would otherwise cut it short half-way, its directory, disk,
        uid and caps left until a reaper came. What a caller gives up on is its provider's, which waits
        for it at its close (``LocalSandboxProvider.aclose``)."""
        task = self._stop_task
        if task is None or (task.done() and not self._stopped):  # never begun, or failed: once more
            task = self._stop_task = asyncio.ensure_future(self._stop())
            self._provider.finish_at_close(task)
        await asyncio.shield(task)

    async def end_commands(self) -> None:
        """The agent is done with this sandbox: end every process of it now, before its stop, and let its
        server serve the provider's next sandbox (most often the session's grading one, which then forks
        no server of its own: ~3 ms of CPU). Its files stay until ``stop``, readable (``read_file``, the
        workspace carried to the grading sandbox), and count toward its caps, which stay here: the
        server takes others. No command runs in it after. Does nothing where its server cannot be
        handed on, or something of it still runs; ``stop`` then does it all."""
        async with self._stop_lock:
            server = self._server
            busy = self._running or not server.idle
            if self._stopping or self._ended or busy or not self._provider.may_hand_on(server):
                return
            self._ended = True  # from here no exec: the server is about to be another sandbox's
            if await server.hand_on(self._grace + sup.DRAIN_S + 2.0):
                self._handed_early = True
                self._handed_with = server.marker_token
                # The next sandbox gives it caps of its own; until one does, it is still in ours.
                server.cgroups = {}
                await self._provider.keep_server(server, usable=True)

    async def _stop(self) -> None:
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
            bound = self._grace + sup.DRAIN_S + 2.0
            # A server that empties its namespace serves a later sandbox, its caps with it: a forked
            # server's start and exit (~3 ms of CPU) a sandbox less (LocalSandboxProvider.keep_server).
            handed_on = False
            if self._handed_early:
                pass  # our processes ended with its namespace's emptying, which it said
            elif not overran and not self._ended and self._provider.may_hand_on(self._server):
                handed_on = await self._server.hand_on(bound)
            else:
                await self._server.close(bound)
            clean = not overran and (handed_on or self._namespace_emptied)
            if not clean:  # a walk of all of /proc for our marker: milliseconds, needed only here
                overran.append(self._server.pid)
                clean = await asyncio.to_thread(_kill_tree, overran, self._marker, sweep=True, grace_s=0)
            if not clean:
                raise SandboxError(f"sandbox {self.id}: processes still alive after stop")
            if self._handed_early and self._provider.reclaim(self._server, self._handed_with):
                # No sandbox took it, and it is still in our caps, empty of all else: they go on with it
                # after our release, as with a server handed on at the stop.
                self._server.cgroups, handed_on = self._caps, True
            try:
                await self._release(handed_on)
            finally:
                if handed_on:  # last: nothing of this sandbox's is left for the next one to meet
                    await self._provider.keep_server(self._server, usable=self._stopped)

    @property
    def _namespace_emptied(self) -> bool:
        """Whether every process of ours ended with our PID namespace, as its server said: at its exit,
        or when it was handed on from us (``end_commands``)."""
        return self._handed_early or self._server.emptied_its_namespace

    @property
    def _caps(self) -> dict[str, str]:
        caps = {pidlimit.PIDS: self.pids_cgroup, pidlimit.MEMORY: self.memory_cgroup}
        return {controller: group for controller, group in caps.items() if group}

    async def _release(self, handed_on: bool) -> None:
        """What a stopped sandbox holds besides its processes: its caps (unless they went on with its
        server), its disk, its uid, its descriptor and directory."""
        caps = self._caps
        if not handed_on and not (self._namespace_emptied and self._provider.keep_caps(caps)):
            await remove_caps(caps.values())
        if self._keep:  # its files copied onto the disk first
            await asyncio.to_thread(self._unmount_disk)
        else:  # a lazy unmount and an rmdir (~80 us): less than a thread's hand-off (``start``'s lay-out)
            self._unmount_disk()
        if self._lease is not None:  # its processes are gone: the uid is free for another sandbox
            self._lease.release()
        self.descriptor_path.unlink(missing_ok=True)  # gone already with a tmpfs of its own
        if not self._keep and not self.session_fs:
            self._provider.remove_later(self.root, self._owner)
        self._stopped = True

    def _unmount_disk(self) -> None:
        if self._provider.disk_fs or self.session_fs:
            keep = self._keep_files if self._keep else None
            diskfs.unmount(str(self.root), keep, session=self.session_fs, spare=self._spare_mount_point)

    def _spare_mount_point(self, session_dir: str) -> bool:
        return self._provider.mount_points.keep(session_dir, self._owner)

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


async def remove_caps(groups: Iterable[str]) -> None:
    """Remove a sandbox's cgroups (by ``cgroup.procs`` path): at once, or in a thread that waits a little
    where the kernel still counts a process killed a moment ago."""
    for group in set(groups):
        if not pidlimit.remove(group):
            await asyncio.to_thread(pidlimit.remove, group, 2.0)


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
