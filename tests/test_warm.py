"""The warm executor: `rollout up` leaves a local cluster whose workers serve run after run, `rollout run`
attaches to it (and only to it: never a stray cluster), `rollout down` or the idle timeout stops it with
nothing left running. How fast an attached run is, is `rollout bench --parts e`'s to measure."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from executor import warm
from executor.store import read_table
from tests.conftest import REPO, ended, processes_under, rollout_run, stopped_by
from tests.test_fast_exit import _config, _gone

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("codex_installed")]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of a shell with its own warm directory and Ray temp dir (every Ray process of the
    warm cluster names the latter on its command line, so what is left of it can be found)."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rr-warm-", dir="/tmp"))
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    shell = {**base, "ROLLOUT_WARM_DIR": str(tmp_path / "warm"), "RAY_TMPDIR": str(ray_tmp)}
    yield shell
    record = warm.live_record(tmp_path / "warm")
    if record is not None:  # a failed test's daemon: ours, ended by its pid
        os.kill(record.pid, signal.SIGKILL)
    _gone(str(ray_tmp))
    shutil.rmtree(ray_tmp, ignore_errors=True)


def _rollout(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )


def _run(tmp_path: Path, env: dict[str, str], run_id: str, extra: str = "") -> tuple[set[str], str]:
    """One `rollout run` of two tasks; the worker ids its rows name, and its stderr."""
    proc = rollout_run(_config(tmp_path, run_id, 2, extra), env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = read_table(tmp_path / "out" / run_id, ["worker_id", "reward"]).to_pydict()
    assert table["reward"] == [1.0, 1.0]
    return set(table["worker_id"]), proc.stderr


def test_runs_attach_to_the_warm_workers_and_down_leaves_nothing(tmp_path, env):
    # With a config: its workers are built now, and the first run finds them ready.
    up = _rollout(env, "up", str(_config(tmp_path, "one", 2)), "--idle-timeout", "600")
    assert up.returncode == 0, up.stderr[-3000:]
    assert "warm executor up" in up.stdout and "warmed 1 workers" in up.stdout
    record = warm.live_record(tmp_path / "warm")
    assert record is not None
    # The record names the cluster's node: an attaching driver is spared Ray's scan of every process.
    assert [n.hex() for n in _alive_nodes(record)] == [record.node_id]
    again = _rollout(env, "up")
    assert "already up" in again.stdout and warm.live_record(tmp_path / "warm") == record

    first, _ = _run(tmp_path, env, "one")
    second, _ = _run(tmp_path, env, "two")
    assert first == second and len(first) == 1  # the same worker process served both runs
    # Each attached driver left its connection for its exit to close (no ray.shutdown): the cluster saw
    # both go, and served the second after the first.
    assert _connected_drivers(record) == []
    (worker_id,) = first
    worker_pid = int(worker_id.rsplit("-", 1)[1])
    # Ray starts its workers at nice 15; a rollout worker's steps are on its sessions' paths, so each of
    # its threads runs at the normal priority (executor/priority.py), as a harness by hand would.
    assert _thread_priorities(worker_pid) == {0}

    # A run that asks for a cluster of its own gets one, warm executor or not.
    own, _ = _run(tmp_path, env, "own", extra="ray_address: local\n")
    assert own.isdisjoint(first)

    # Another gateway (or sandbox, model, harness) section: the same worker process serves it, with a
    # gateway built anew from it (this one keeps no bodies, where the first run's kept them).
    rebuilt, _ = _run(tmp_path, env, "rebuilt", extra="gateway: {keep_bodies: false}\n")
    assert rebuilt == first
    assert list((tmp_path / "out" / "one").rglob("req-*.json.gz"))
    assert not list((tmp_path / "out" / "rebuilt").rglob("req-*.json.gz"))

    # Another shape of worker actor (sessions per worker): fresh workers, and the old set is ended.
    config = _config(tmp_path, "changed", 2)
    config.write_text(config.read_text().replace("sessions_per_worker: 2", "sessions_per_worker: 3"))
    proc = rollout_run(config, env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    changed = set(read_table(tmp_path / "out" / "changed", ["worker_id"]).to_pydict()["worker_id"])
    assert changed.isdisjoint(first)
    # Ended by ray.kill, which returns before the process has gone.
    assert ended(worker_pid, bound_s=60)

    # One run at a time: while the lease is held, a run starts a cluster of its own and says why.
    lease = warm.attach(tmp_path / "warm")
    assert lease is not None
    try:
        busy, stderr = _run(tmp_path, env, "busy", extra="gateway: {max_attempts_per_request: 2}\n")
    finally:
        lease.release()
    assert busy.isdisjoint(changed)
    assert "busy with another run" in stderr

    down = _rollout(env, "down")
    assert down.returncode == 0 and f"stopped (pid {record.pid})" in down.stdout
    assert warm.live_record(tmp_path / "warm") is None
    assert not (tmp_path / "warm" / warm.RECORD).exists()
    assert _gone(env["RAY_TMPDIR"]) == []
    assert processes_under(str(tmp_path / "sandboxes")) == []
    assert "no warm executor" in _rollout(env, "down").stdout


def _alive_nodes(record: warm.Record) -> list[Any]:
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    gcs = GcsClient(address=record.gcs_address)
    return list(gcs.get_all_node_info(state_filter=GcsNodeInfo.GcsNodeState.ALIVE))


def _connected_drivers(record: warm.Record, bound_s: float = 30.0) -> list[int]:
    """The pids of the drivers the warm cluster still counts as connected, its daemon's aside, once
    those whose process ended had time to be noticed."""
    from ray._raylet import GcsClient

    gcs = GcsClient(address=record.gcs_address)
    deadline = time.monotonic() + bound_s
    while True:
        jobs = gcs.get_all_job_info().values()
        live = [j.driver_pid for j in jobs if not j.is_dead and j.driver_pid != record.pid]
        if not live or time.monotonic() >= deadline:
            return live
        time.sleep(0.2)  # waiting for a condition, bounded; not synchronisation by sleeping


def _released(lock: Path, bound_s: float) -> bool:
    """Whether the daemon lets go of its lock (it exits) within ``bound_s``."""
    fd = os.open(lock, os.O_RDONLY)
    import fcntl

    done = threading.Event()

    def wait() -> None:
        fcntl.flock(fd, fcntl.LOCK_SH)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    try:
        return done.wait(bound_s)
    finally:
        os.close(fd)


# Ray's bound on an agent's last report (publish_error_to_driver's 60 s), and some.
_AGENTS_LAST_REPORT_S = 90.0


def _thread_priorities(pid: int) -> set[int]:
    """The nice values of ``pid``'s threads (a thread that ended meanwhile aside)."""
    values = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            values.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
    return values


def test_it_stops_itself_when_idle_and_a_killed_one_is_never_attached(tmp_path, env):
    directory = tmp_path / "warm"
    up = _rollout(env, "up", "--idle-timeout", "1")
    assert up.returncode == 0 and "warm executor up" in up.stdout  # it may be idle and gone already
    assert _released(directory / warm.DAEMON_LOCK, bound_s=120)
    assert warm.live_record(directory) is None and _gone(env["RAY_TMPDIR"]) == []

    assert _rollout(env, "up", "--idle-timeout", "600").returncode == 0
    record = warm.live_record(directory)
    assert record is not None
    os.kill(record.pid, signal.SIGKILL)
    assert _released(directory / warm.DAEMON_LOCK, bound_s=60)
    # Its record is left behind, stale: a run starts its own cluster, `down` clears the record.
    assert (directory / warm.RECORD).exists()
    ids, _ = _run(tmp_path, env, "after-kill")
    assert ids
    # The killed daemon's cluster goes with it. Its raylet's two agents see the raylet's end at once and
    # report it to the GCS before they exit; on Ray 2.49 that report waits out Ray's 60 s bound on a GCS
    # that is gone too (2.60 gives up at once), so they are given that bound, and some.
    assert _gone(env["RAY_TMPDIR"], bound_s=_AGENTS_LAST_REPORT_S) == []
    assert "no warm executor" in _rollout(env, "down").stdout
    assert not (directory / warm.RECORD).exists()


def test_bad_input_to_up_is_one_line(tmp_path, env):
    proc = _rollout(env, "up", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "missing.yaml" in proc.stderr
    assert warm.live_record(tmp_path / "warm") is None


def _command(
    env: dict[str, str], *args: str, preexec: Callable[[], Any] | None = None
) -> subprocess.CompletedProcess[str]:
    """The ``rollout`` command as a user's shell runs it: the entry point that hands a run over."""
    argv = [sys.executable, "-m", "executor", *args]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=300, cwd=REPO, env=env, preexec_fn=preexec
    )


def _fewer_files() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096) - 1, hard))


def _served(log: Path, config: Path) -> list[str]:
    """The server's lines about the runs of ``config`` it forked a driver for, and how they exited."""
    lines = log.read_text().splitlines()
    pids = [ln.rsplit(" ", 1)[1] for ln in lines if "serving `rollout run" in ln and str(config) in ln]
    return [ln for ln in lines if any(re.search(rf"pid {p}\b", ln) for p in pids)]


def test_a_run_is_handed_to_the_pre_imported_driver_and_behaves_as_in_its_own_process(tmp_path, env):
    from executor.warm_files import SOCKET

    assert _command(env, "up", "--idle-timeout", "600").returncode == 0
    log = tmp_path / "warm" / warm.LOG
    assert (tmp_path / "warm" / SOCKET).exists()
    assert oct((tmp_path / "warm" / SOCKET).stat().st_mode & 0o777) == "0o600"

    # Served: the command's output, exit code and rows are the run's own.
    config = _config(tmp_path, "handed", 2).rename(tmp_path / "handed.yaml")
    proc = _command(env, "run", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rows: 2  final: 2" in proc.stdout
    assert read_table(tmp_path / "out" / "handed", ["reward"]).to_pydict()["reward"] == [1.0, 1.0]
    served = _served(log, config)
    assert len(served) == 2 and served[1].endswith("exited 0"), log.read_text()[-2000:]

    # Bad input: its one line on the command's stderr, its exit code the command's.
    missing = tmp_path / "missing.yaml"
    bad = _command(env, "run", str(missing))
    assert bad.returncode == 2 and bad.stdout == ""
    assert len(bad.stderr.strip().splitlines()) == 1 and "missing.yaml" in bad.stderr
    assert _served(log, missing)[-1].endswith("exited 2")

    # An environment its imports did not see: refused, and the command runs the run itself.
    other = _config(tmp_path, "other-env", 2).rename(tmp_path / "other-env.yaml")
    proc = _command({**env, "RAY_DEDUP_LOGS": "0"}, "run", str(other))
    assert proc.returncode == 0 and "rows: 2  final: 2" in proc.stdout, proc.stderr[-3000:]
    assert _served(log, other) == []
    assert "refused a run: the environment differs where modules read it at import: ['RAY_DEDUP_LOGS']" in (
        log.read_text()
    )

    # What the command's process has that a module does not read: taken on (its umask), or refused
    # when it differs from the server's (its resource limits).
    masked = _config(tmp_path, "masked", 1).rename(tmp_path / "masked.yaml")
    proc = _command(env, "run", str(masked), preexec=lambda: os.umask(0o077))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _served(log, masked)[-1].endswith("exited 0")
    assert (tmp_path / "out" / "masked" / "summary.json").stat().st_mode & 0o077 == 0
    limited = _config(tmp_path, "limited", 1).rename(tmp_path / "limited.yaml")
    proc = _command(env, "run", str(limited), preexec=_fewer_files)
    assert proc.returncode == 0 and "rows: 1  final: 1" in proc.stdout, proc.stderr[-3000:]
    assert _served(log, limited) == [] and "refused a run: other resource limits" in log.read_text()

    # A command in other namespaces (as a sandbox's commands are) is refused, whoever it runs as.
    elsewhere = _config(tmp_path, "elsewhere", 1).rename(tmp_path / "elsewhere.yaml")
    proc = subprocess.run(
        ["unshare", "--mount", sys.executable, "-m", "executor", "run", str(elsewhere)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0 and "rows: 1  final: 1" in proc.stdout, proc.stderr[-3000:]
    assert _served(log, elsewhere) == [] and "is not in the server's namespaces" in log.read_text()

    # Nothing a command sends ends the server; one that goes before the go-ahead gets no driver.
    _send_raw(tmp_path / "warm" / SOCKET, b"[]")
    ghost = _config(tmp_path, "ghost", 1).rename(tmp_path / "ghost.yaml")
    pid = _send_raw(tmp_path / "warm" / SOCKET, _request(env, ["run", str(ghost)]))
    assert pid is not None and ended(pid, bound_s=30)
    assert _waited(lambda: "the command's driver did not start" in log.read_text(), 30)
    assert not (tmp_path / "out" / "ghost").exists()

    # Ctrl-C reaches the driver: it stops as a run in its own process does, its rows kept.
    hang = tmp_path / "hang.jsonl"
    hang.write_text(json.dumps({"id": "slow", "prompt": "p", "deadline_s": 300, "model_script": [HANG]}))
    interrupted = tmp_path / "interrupted.yaml"
    interrupted.write_text(
        f"tasks: {hang}\nout: {tmp_path / 'out'}\nrun_id: interrupted\n"
        f"sandbox: {{root: {tmp_path / 'sandboxes'}}}\n"
    )
    assert _signalled(env, interrupted, signal.SIGINT) == 130  # 128 + SIGINT, as a shell says it
    summary = json.loads((tmp_path / "out" / "interrupted" / "summary.json").read_text())
    assert summary["stopped"] == "stopped by SIGINT" and summary["pending"] == 1
    assert _served(log, interrupted)[-1].endswith("exited 130")

    # A command killed outright: its driver is interrupted as by a Ctrl-C, and stops as cleanly.
    (tmp_path / "out" / "interrupted" / "summary.json").unlink()
    assert _signalled(env, interrupted, signal.SIGKILL) == -signal.SIGKILL
    assert _waited(lambda: _served(log, interrupted)[-1].endswith("exited 130"), 120), log.read_text()[-2000:]
    assert "went; interrupted it" in _served(log, interrupted)[-2]
    summary = json.loads((tmp_path / "out" / "interrupted" / "summary.json").read_text())
    assert summary["stopped"] == "stopped by SIGINT" and summary["pending"] == 1

    # Source edited since the server's imports: refused, the run made in its own process, and a fresh
    # server (the executor starts one) serves the next.
    edited = REPO / "executor" / "phases.py"
    times = edited.stat()
    os.utime(edited, ns=(times.st_atime_ns, times.st_mtime_ns + 1_000_000_000))
    try:  # edited until the fresh server has served: it imports the edited tree, whenever it starts
        stale = _config(tmp_path, "stale", 1).rename(tmp_path / "stale.yaml")
        proc = _command(env, "run", str(stale))
        assert proc.returncode == 0 and "rows: 1  final: 1" in proc.stdout, proc.stderr[-3000:]
        changed = "refused a run: source files or installed packages changed"
        assert _served(log, stale) == [] and changed in log.read_text()
        restarted = "starting a fresh one"
        assert _waited(lambda: restarted in log.read_text() and (tmp_path / "warm" / SOCKET).exists(), 60)
        fresh = _config(tmp_path, "fresh", 1).rename(tmp_path / "fresh.yaml")
        assert _command(env, "run", str(fresh)).returncode == 0
        assert _served(log, fresh)[-1].endswith("exited 0")
    finally:
        os.utime(edited, ns=(times.st_atime_ns, times.st_mtime_ns))

    down = _command(env, "down")
    assert down.returncode == 0
    assert _gone(str(tmp_path / "warm")) == []  # the server, and every driver it forked
    assert not (tmp_path / "warm" / SOCKET).exists()
    assert processes_under(str(tmp_path / "sandboxes")) == []


HANG = {"type": "hang", "max_s": 600}


def _note_progress(command: subprocess.Popen[str], seen: threading.Event) -> None:
    assert command.stderr is not None
    for line in command.stderr:
        if '"event": "progress"' in line and '"in_flight": 1' in line:
            seen.set()


def _signalled(env: dict[str, str], config: Path, signum: int) -> int:
    """Start `rollout run CONFIG`, send it ``signum`` once its driver's loop is going; its exit code."""
    command = subprocess.Popen(
        [sys.executable, "-m", "executor", "run", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,  # where progress goes
        text=True,
        cwd=REPO,
        env=env,
    )
    progress = threading.Event()
    reader = threading.Thread(target=_note_progress, args=(command, progress), daemon=True)
    reader.start()
    try:
        assert progress.wait(120), "no progress line within the bound"
        return stopped_by(command, signum, 180)
    finally:
        if command.poll() is None:
            command.kill()
        reader.join(timeout=30)


def _waited(condition: Callable[[], bool], bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)  # waiting for a condition, bounded; not synchronisation by sleeping
    return True


def _request(env: dict[str, str], args: list[str]) -> bytes:
    """The body of a request as the command sends it, from this process, with ``env`` as its environment."""
    from executor.driver_server import request_of

    return json.dumps({**request_of(args), "env": env, "cwd": str(REPO)}).encode()


def _send_raw(path: Path, body: bytes) -> int | None:
    """Send ``body`` as a request with this process's standard files; the pid the server answers with
    (then leave without the go-ahead), or None."""
    import array
    import socket
    import struct

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        fds = array.array("i", [0, 1, 2])
        sock.sendmsg([struct.pack("!I", len(body))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        sock.sendall(body)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk, ancillary, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(4))
            for _level, _kind, data in ancillary:
                for fd in array.array("i", data[: len(data) - len(data) % 4]):
                    os.close(fd)
            if not chunk:
                return None
            answer += chunk
    pid = json.loads(answer).get("pid")
    return pid if isinstance(pid, int) else None
