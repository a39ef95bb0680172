"""A warm local executor: ``rollout up`` leaves a local Ray cluster running whose worker actors stay warm
between runs (harness found, gateway listening, a spare sandbox server started); ``rollout run`` attaches
to it instead of starting a cluster, ``rollout down`` stops it, and it stops itself once idle.

Three files in ``warm_dir()`` are the whole of its state, so that nothing but our own files can make a
run attach (never a cluster someone else left on the machine):

    executor.json  the record: the daemon's pid and its cluster's GCS address
    daemon.lock    held (flock) by the daemon for its whole life: a record whose lock is free is stale
    lease.lock     held by the one run attached; its mtime is when a run last came or went

One run at a time: a run that finds the lease taken starts a cluster of its own, as without ``up``.
Workers are keyed by what they build once (model, gateway, sandbox, harness, their concurrency) and by
the code they run, so a changed config, harness version or checkout gets fresh workers.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from executor.tasks import InputError
from executor.warm_files import DAEMON_LOCK, LEASE_LOCK, LOG, RECORD, SOCKET, warm_dir

if TYPE_CHECKING:
    from executor.config import RunConfig

log = logging.getLogger(__name__)

NAMESPACE = "rollout-warm"
DEFAULT_IDLE_TIMEOUT_S = 1800.0
UP_TIMEOUT_S = 120.0
LEASE_WAIT_S = 0.5  # the daemon's idle probe holds the lease for a moment: that is no attached run
CLOSE_S = 30.0
_PACKAGES = ("executor", "harnesses", "sandboxes", "policy")


class WarmError(Exception):
    """The warm executor cannot be started or stopped as asked; the message is one line."""


@dataclass(frozen=True)
class Record:
    pid: int
    gcs_address: str
    idle_timeout_s: float
    started_at: float  # wall clock, for people
    node_id: str = ""  # the cluster's one node (hex); "" in a record written before it was kept


def _open_lock(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _locked_elsewhere(path: Path) -> bool:
    """True while another process holds ``path``'s lock (flock crosses PID namespaces, unlike a pid)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def live_record(directory: Path | None = None) -> Record | None:
    """The running warm executor's record, or None (none started, or its daemon is gone)."""
    directory = directory or warm_dir()
    try:
        data = json.loads((directory / RECORD).read_text(encoding="utf-8"))
        record = Record(**data)
    except (OSError, ValueError, TypeError):
        return None
    return record if _locked_elsewhere(directory / DAEMON_LOCK) else None


class Lease:
    """The attached run's hold on the warm executor; ``release`` when the run's work is safe."""

    def __init__(self, fd: int, path: Path, record: Record) -> None:
        self._fd: int | None = fd
        self.path = path
        self.record = record

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.utime(self.path)  # the idle clock starts when the last run leaves
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def attach(directory: Path | None = None) -> Lease | None:
    """Take the lease of a live warm executor; None when there is none or another run holds it."""
    directory = directory or warm_dir()
    record = live_record(directory)
    if record is None:
        return None
    from harnesses.install import flock_within

    fd = _open_lock(directory / LEASE_LOCK)
    if not flock_within(fd, time.monotonic() + LEASE_WAIT_S, pause_s=0.02):
        os.close(fd)
        log.warning("the warm executor (pid %d) is busy with another run", record.pid)
        return None
    # The daemon removes its record while it holds the lease to stop: read it again under the lease.
    if live_record(directory) != record:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        return None
    os.utime(directory / LEASE_LOCK)
    return Lease(fd, directory / LEASE_LOCK, record)


# ---------------------------------------------------------------------------------------------------------
# The daemon: `python -m executor.warm serve`, started by `up`


def _idle(lease_fd: int, lease_path: Path, idle_timeout_s: float) -> bool:
    """True, with the lease taken and kept (no run can attach any more), once no run has been attached
    for ``idle_timeout_s``."""
    try:
        fcntl.flock(lease_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        idle_s = time.time() - lease_path.stat().st_mtime
    except OSError:
        idle_s = 0.0
    if idle_s >= idle_timeout_s:
        return True
    fcntl.flock(lease_fd, fcntl.LOCK_UN)
    return False


def serve(idle_timeout_s: float, ready_fd: int | None) -> int:
    """Hold a local cluster until ``down`` (SIGTERM) or ``idle_timeout_s`` without a run."""
    directory = warm_dir()
    daemon_fd = _open_lock(directory / DAEMON_LOCK)
    try:
        fcntl.flock(daemon_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("warm executor: another one holds this directory", file=sys.stderr)
        return 1
    lease_path = directory / LEASE_LOCK
    lease_fd = _open_lock(lease_path)
    os.utime(lease_path)  # idle from now
    # Its imports overlap the cluster's start.
    drivers = _DriverServer(directory)
    from executor.local_ray import start_local_ray, stop_local_ray

    gcs = start_local_ray()
    stop = threading.Event()
    # After ray.init, which sets a SIGTERM handler of its own that exits at once.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    import ray

    record = Record(os.getpid(), gcs, idle_timeout_s, time.time(), ray.get_runtime_context().get_node_id())
    tmp = directory / (RECORD + ".tmp")
    tmp.write_text(json.dumps(asdict(record)), encoding="utf-8")
    os.replace(tmp, directory / RECORD)
    drivers.wait_ready()
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    log.warning("warm executor up: pid %d, cluster %s, idle timeout %.0f s", record.pid, gcs, idle_timeout_s)
    check_s = min(10.0, max(idle_timeout_s / 4, 0.2))
    reason = "rollout down"
    while not stop.wait(check_s):
        if _idle(lease_fd, lease_path, idle_timeout_s):
            reason = f"idle for {idle_timeout_s:.0f} s"
            break
        drivers.keep_up()
    else:
        # `down`: a run still attached finishes first (its sessions are bounded by their deadlines).
        fcntl.flock(lease_fd, fcntl.LOCK_EX)
    # Under the lease: no run can attach while the cluster goes.
    (directory / RECORD).unlink(missing_ok=True)
    log.warning("warm executor stopping: %s", reason)
    drivers.stop()
    stop_local_ray(named_workers())
    return 0


class _DriverServer:
    """The warm executor's pre-imported driver (executor/driver_server.py): started with it, started
    again when it stopped (its imports went stale), stopped with it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        # As `rollout up` was given them: Ray adds variables to this process's environment once it
        # starts, and raises its limit of open files.
        from executor.driver_handover import process_traits

        self.env = dict(os.environ)
        self.limits = json.dumps(process_traits()["limits"])
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_r: int | None = None
        self.was_ready = False  # one that never listened (a socket path too long, say) is not restarted
        self.retired: list[subprocess.Popen[bytes]] = []  # stale ones finishing their runs
        self._start()

    def _start(self) -> None:
        ready_r, ready_w = os.pipe()
        with open(self.directory / LOG, "ab") as logfile:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "executor.driver_server",
                    str(self.directory / SOCKET),
                    str(ready_w),
                    self.limits,
                ],
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=logfile,
                pass_fds=(ready_w,),
                cwd=Path(__file__).parents[1],
                env=self.env,
            )
        os.close(ready_w)
        self.ready_r = ready_r

    def wait_ready(self, timeout_s: float = UP_TIMEOUT_S / 2) -> None:
        """Until it listens: a run right after `up` finds it. Without it runs still attach, slower."""
        if self.ready_r is None:
            return
        try:
            readable, _, _ = select.select([self.ready_r], [], [], timeout_s)
            self.was_ready = bool(readable and os.read(self.ready_r, 16))
            if not self.was_ready:
                log.warning("the pre-imported driver did not start; runs import their own (%s)", LOG)
        finally:
            os.close(self.ready_r)
            self.ready_r = None

    def keep_up(self) -> None:
        """A fresh server once this one stopped listening (its imports went stale, or it died); one that
        stopped listening finishes its runs' drivers and exits by itself."""
        self.retired = [p for p in self.retired if p.poll() is None]
        if not self.was_ready or self.proc is None:
            return
        if self.proc.poll() is None and (self.directory / SOCKET).exists():
            return
        log.warning("the pre-imported driver stopped taking runs; starting a fresh one")
        if self.proc.poll() is None:
            self.proc.terminate()  # it stops listening (if it still did) and exits once its drivers have
            self.retired.append(self.proc)
        self._start()
        self.wait_ready()

    def stop(self) -> None:
        """Each server stops taking runs at once, and exits once the runs it started (none attached to
        this executor: the lease is held) have ended."""
        for proc in [self.proc, *self.retired]:
            if proc is not None and proc.poll() is None:
                proc.terminate()


def up(
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, timeout_s: float = UP_TIMEOUT_S
) -> tuple[Record, bool]:
    """Start the warm executor, or find the one running; (its record, whether this call started it)."""
    directory = warm_dir()
    running = live_record(directory)
    if running is not None:
        return running, False
    directory.mkdir(parents=True, exist_ok=True)
    ready_r, ready_w = os.pipe()
    with open(directory / LOG, "ab") as logfile:
        # Its own session: the daemon outlives this command and the terminal it ran in.
        proc = subprocess.Popen(
            [sys.executable, "-m", "executor.warm", "serve", str(idle_timeout_s), str(ready_w)],
            stdin=subprocess.DEVNULL,
            stdout=logfile,
            stderr=logfile,
            pass_fds=(ready_w,),
            start_new_session=True,
            cwd=Path(__file__).parents[1],
        )
    os.close(ready_w)
    try:
        readable, _, _ = select.select([ready_r], [], [], timeout_s)
        ready = os.read(ready_r, 16) if readable else b""
    finally:
        os.close(ready_r)
    record = live_record(directory)
    if not ready or record is None:
        if proc.poll() is None:
            proc.kill()
        tail = _tail(directory / LOG)
        raise WarmError(
            f"the warm executor did not start within {timeout_s:.0f} s; {directory / LOG}: {tail}"
        )
    return record, True


def down(timeout_s: float = CLOSE_S * 4) -> Record | None:
    """Stop the warm executor (after the run attached to it, if any); None when none was running."""
    directory = warm_dir()
    record = live_record(directory)
    if record is None:
        (directory / RECORD).unlink(missing_ok=True)  # a stale record of a daemon that was killed
        return None
    try:
        os.kill(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        return record
    fd = os.open(directory / DAEMON_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return record
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise WarmError(
                        f"the warm executor (pid {record.pid}) is still stopping after {timeout_s:.0f} s: "
                        "a run attached to it finishes first"
                    ) from None
                time.sleep(0.05)
    finally:
        os.close(fd)


def _tail(path: Path, limit: int = 300) -> str:
    try:
        text = path.read_bytes()[-4096:].decode("utf-8", "replace")
    except OSError as exc:
        return f"unreadable ({errno.errorcode.get(exc.errno or 0, exc)})"
    lines = [line for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else "(empty)")[:limit]


# ---------------------------------------------------------------------------------------------------------
# Workers, from an attached driver


def code_fingerprint() -> str:
    """Our modules' paths, sizes and mtimes: an edited checkout must not run in workers of the old code."""
    root = Path(__file__).parents[1]
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            st = path.stat()
            digest.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return digest.hexdigest()


def worker_key(cfg: RunConfig) -> str:
    """What a worker actor is created with (its concurrency and resources) and the code it runs: two runs
    with the same key share warm workers. What a worker builds from the rest of the config (gateway,
    provider, harness) it rebuilds in its process when a run brings another (SandboxWorker._rebind):
    ~0.1 s, where a new actor's process and imports cost ~1.2 s (`rollout bench --parts e`)."""
    concurrency = cfg.concurrency
    built = [concurrency.sessions_per_worker, concurrency.worker_resources, code_fingerprint()]
    return hashlib.sha256(json.dumps(built, sort_keys=True).encode()).hexdigest()[:16]


def named_workers(keep: str | None = None) -> list[Any]:
    """The warm workers of every key but ``keep``: ``keep=None`` lists all of them."""
    import ray

    handles = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != NAMESPACE or (keep and entry["name"].startswith(f"w-{keep}-")):
            continue
        with contextlib.suppress(ValueError):
            handles.append(ray.get_actor(entry["name"], namespace=NAMESPACE))
    return handles


def workers(cfg: RunConfig, run_dir: str, worker_class: Any, options: dict[str, Any]) -> list[Any]:
    """This run's workers: the warm ones of its key (created detached on first use), bound to the run;
    workers of other keys are closed and ended, so one config's set is warm at a time."""
    import ray
    from ray.exceptions import RayError

    key = worker_key(cfg)
    stale = named_workers(keep=key)
    if stale:
        with contextlib.suppress(RayError, TimeoutError):
            ray.get([w.close.remote() for w in stale], timeout=CLOSE_S)
        for w in stale:
            ray.kill(w, no_restart=True)
    config_json = cfg.model_dump_json()
    handles = [
        worker_class.options(
            name=f"w-{key}-{i}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True, **options
        ).remote(config_json, run_dir, i)
        for i in range(cfg.concurrency.workers)
    ]
    if cfg.model.api_key_env:
        from executor.worker import key_digest

        nonce = secrets.token_bytes(16)
        if not ray.get(handles[0].key_matches.remote(nonce, key_digest(cfg.model.api_key_env, nonce))):
            raise InputError(
                f"model.api_key_env: {cfg.model.api_key_env} differs from the one the warm executor was "
                "started with (its workers read the environment of `rollout up`); run `rollout down` and "
                "`rollout up` in this shell, or give --address local for a cluster of the run's own"
            )
    return handles


def connect(record: Record) -> None:
    """Connect this process's driver to the warm executor's cluster.

    Ray finds the node a driver connects to by reading every process's command line on the machine for
    a raylet's ``--node_id`` (~10 ms of CPU with 200 processes; 1.8 s, profiled, with 4,900 on a loaded
    machine): the record names the node, so that scan is skipped. A record without it, or a node no
    longer alive, gets Ray's own search (the scan, then GCS), as does a Ray without the scan's function
    (executor/ray_private.py)."""
    import ray

    from executor import ray_private
    from executor.local_ray import loopback_only

    def known_node_first(scan: Any) -> Any:
        answers = iter([[record.node_id]] if record.node_id else [])
        return lambda: next(answers, None) or scan()

    with ray_private.patched("ray._private.services.find_node_ids", known_node_first), loopback_only():
        ray.init(address=record.gcs_address, log_to_driver=False)


def prewarm(cfg: RunConfig, worker_class: Any, options: dict[str, Any]) -> list[str]:
    """Build ``cfg``'s warm workers now (``rollout up CONFIG``), so the first run finds them ready; the
    ids of the workers. Attaches as a run would, so no run is served meanwhile."""
    import ray

    lease = attach()
    if lease is None:
        raise WarmError("the warm executor is busy with a run (or gone); try again when it is idle")
    try:
        connect(lease.record)
        try:
            warming = cfg.model_copy(update={"run_id": "warm-up"})
            handles = workers(warming, str(warm_dir() / "warm-up"), worker_class, options)
            ids = ray.get([w.prepare.remote() for w in handles], timeout=UP_TIMEOUT_S)
            release(handles)
        finally:
            ray.shutdown()
    finally:
        lease.release()
    return list(ids)


def release(handles: list[Any]) -> None:
    """The run is over: each worker lets go of what was the run's (its prepared workspaces) and keeps
    the rest warm for the next run."""
    import ray
    from ray.exceptions import RayError

    try:
        ray.get([w.release.remote() for w in handles], timeout=CLOSE_S)
    except (RayError, TimeoutError) as exc:
        log.warning("warm workers did not all release within %.0f s: %s", CLOSE_S, str(exc)[:500])


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "serve":
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return serve(float(argv[1]), int(argv[2]))
    print("usage: python -m executor.warm serve IDLE_TIMEOUT_S READY_FD", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
