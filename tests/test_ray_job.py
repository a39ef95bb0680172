"""`rollout run` and the clusters around it: without an address it starts a local Ray of its own even
where `ray start` left a cluster on the machine; under `ray job submit --working-dir`, an output root in
Ray's copy of the working directory (deleted after the job) is refused before anything is written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from executor.cluster import RUNTIME_ENV_DIR, WORKING_DIR_FILES, check_out, cluster_address, ray_working_dir
from executor.reaper import GATEWAY_SOCKET_PREFIX, _answered
from executor.store import read_table
from executor.tasks import InputError
from sandboxes import pidlimit
from tests.conftest import REPO, processes_under, rollout_run, sandbox_yaml
from tests.ports import free_ports

RAY = Path(sys.executable).parent / "ray"
REFUSED = "inside Ray's copy of the job's working directory"
TASK = json.dumps({"id": "t0", "prompt": "p", "verify": "test -f done.txt"})
HARNESS = "harness: {name: command, command: 'touch done.txt; echo done'}\n"


# --- which cluster, without one running -------------------------------------------------------------


def test_the_run_s_setting_wins_over_ray_address_and_local_means_its_own(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_address("10.0.0.2:6379") == "10.0.0.2:6379"  # --address, else the config's
    assert cluster_address(None) == "10.0.0.1:6379"
    assert cluster_address("local") is None  # a cluster of its own, RAY_ADDRESS or not
    monkeypatch.delenv("RAY_ADDRESS")
    assert cluster_address(None) is None
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert cluster_address(None) is None


# --- where a Ray job's output must not go ------------------------------------------------------------


def test_ray_s_copy_of_a_working_dir_is_recognised(tmp_path):
    session = tmp_path / "ray" / "session_2026-12-01_17-43-51_115145_22566"
    copy = session / RUNTIME_ENV_DIR / WORKING_DIR_FILES / "_ray_pkg_cbe2061bfecd748f"
    assert ray_working_dir(copy / "runs" / "demo") == copy
    assert ray_working_dir(copy) == copy
    assert ray_working_dir(session / RUNTIME_ENV_DIR / WORKING_DIR_FILES) is None
    assert ray_working_dir(tmp_path / "shared" / "runs") is None
    assert ray_working_dir(tmp_path / WORKING_DIR_FILES / "x" / "runs") is None  # not Ray's layout
    with pytest.raises(InputError) as refused:
        check_out(str(copy / "runs"))
    assert REFUSED in str(refused.value) and "absolute path" in str(refused.value)
    check_out(str(tmp_path / "shared" / "runs"))


def test_the_names_are_ray_s(tmp_path):
    """The layout is spelled out so the CLI checks it without importing Ray; this holds it to Ray's."""
    from ray._private.ray_constants import DEFAULT_RUNTIME_ENV_DIR_NAME
    from ray._private.runtime_env.working_dir import WorkingDirPlugin

    assert DEFAULT_RUNTIME_ENV_DIR_NAME == RUNTIME_ENV_DIR
    plugin = WorkingDirPlugin(str(tmp_path / RUNTIME_ENV_DIR), gcs_client=None)  # type: ignore[arg-type]
    assert Path(plugin._resources_dir) == tmp_path / RUNTIME_ENV_DIR / WORKING_DIR_FILES


def _job_dir(root: Path, sandboxes: Path, out: str | Path = "runs") -> Path:
    """A working directory as `ray job submit --working-dir` ships it: config and tasks, paths relative."""
    root.mkdir(parents=True)
    (root / "tasks.jsonl").write_text(TASK + "\n")
    (root / "cfg.yaml").write_text(
        f"tasks: tasks.jsonl\nout: {out}\nsandbox: {{root: {sandboxes}}}\n{HARNESS}"
        "concurrency: {workers: 1, sessions_per_worker: 1}\n"
    )
    return root


def _one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("how", ["config", "flag"])
def test_a_relative_out_in_ray_s_copy_is_refused_before_anything_is_written(tmp_path, how):
    """As in a Ray job: the cwd is Ray's copy of the working directory, the config is in it."""
    copy = tmp_path / "session_x" / RUNTIME_ENV_DIR / WORKING_DIR_FILES / "_ray_pkg_0123"
    _job_dir(copy, tmp_path / "sandboxes", out=tmp_path / "elsewhere" if how == "flag" else "runs")
    args = ["--out", "runs"] if how == "flag" else []
    proc = subprocess.run(
        [sys.executable, "-m", "executor.cli", "run", "cfg.yaml", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=copy,
        env={**os.environ, "COLUMNS": "300", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_error_line(proc.stderr)
    assert f"out {copy / 'runs'}: {REFUSED}" in line and "--out /shared/runs" in line, line
    assert sorted(p.name for p in copy.iterdir()) == ["cfg.yaml", "tasks.jsonl"]
    assert not (tmp_path / "sandboxes").exists() and not (tmp_path / "elsewhere").exists()


# --- against a real `ray start --head` ---------------------------------------------------------------


@dataclass
class Head:
    """A head node this module started with `ray start --head --block`: the process, its ports."""

    proc: subprocess.Popen[bytes]
    temp_root: Path  # RAY_TMPDIR for a process that should find this head the way a bare ray.init() does
    gcs_address: str
    dashboard: str

    @property
    def temp_dir(self) -> Path:
        return self.temp_root / "ray"

    def sessions(self) -> set[Path]:
        return {p for p in self.temp_dir.glob("session_2*") if p.is_dir()}


HEAD_PORTS = (
    "port dashboard-port ray-client-server-port dashboard-agent-listen-port dashboard-agent-grpc-port "
    "node-manager-port object-manager-port runtime-env-agent-port metrics-export-port"
).split()


def start_head(
    root: Path, env: dict[str, str], *, num_cpus: int
) -> tuple[subprocess.Popen[bytes], dict[str, int], Path]:
    """`ray start --head --block` with its temp dir under ``root``, loopback only, every port free and
    named (``HEAD_PORTS``), ``env`` over ours (no RAY_ADDRESS); its process, its ports and its log. End
    it with ``_end``, never `ray stop`."""
    ports = dict(zip(HEAD_PORTS, free_ports(len(HEAD_PORTS)), strict=True))
    # The dashboard spawns its nine modules at once, each importing Ray, and gives each 30 s to say it is
    # ready, else exits: on a loaded 2-core machine one took longer (seen on Ray 2.49.2, MetricsHead), and
    # the head had no dashboard to submit jobs to. The fixture's own bound on the dashboard is 120 s.
    full_env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "120",
        **env,
    }
    full_env.pop("RAY_ADDRESS", None)
    log = root / "head.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(RAY),
                "start",
                "--head",
                "--block",
                "--temp-dir",
                str(root / "ray"),
                "--num-cpus",
                str(num_cpus),
            ]
            + ["--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1"]
            + [f"--{name}={port}" for name, port in ports.items()],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,  # a Ctrl-C of the test run reaches this head through _end only
        )
    return proc, ports, log


def _until(
    what: str, ready: Callable[[], bool], bound_s: float, proc: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + bound_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"ray start --head: no {what} (exit {proc.poll()}): {log.read_text()[-3000:]}")
        time.sleep(0.2)  # waiting for a condition, bounded; not synchronisation by sleeping


def _dashboard_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _end(proc: subprocess.Popen[bytes], marker: str) -> list[str]:
    """End the head this module started, by its pid (`ray stop` would end every cluster on the machine):
    `ray start --block` stops its node's processes on SIGTERM; anything still under the head's temp dir
    after a bound is killed by pid. Returns what was left to kill."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while (left := processes_under(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)  # waiting for a condition, bounded
    for entry in left:
        try:
            os.kill(int(entry.split(":", 1)[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    # Short, under /tmp rather than tmp_path: Ray's socket paths (TEMP/ray/session_.../sockets/...) must
    # fit in 107 bytes. Every process of this head names it on its command line or has its cwd there.
    root = Path(tempfile.mkdtemp(prefix="rr-job-", dir="/tmp"))
    env = {
        "RAY_AUTH_MODE": "disabled",  # as every test cluster here: loopback only, no token to hand out
        "PYTHONPATH": str(REPO),  # what the job's entrypoint imports, as a cluster's nodes install it
    }
    proc, ports, log = start_head(root, env, num_cpus=2)
    address_file = root / "ray" / "ray_current_cluster"
    dashboard = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        _until("address file", address_file.exists, 120, proc, log)
        _until("dashboard", lambda: _dashboard_up(dashboard), 120, proc, log)
        yield Head(proc, root, address_file.read_text().strip(), dashboard)
    finally:
        left = _end(proc, str(root))
        assert not processes_under(str(root)), processes_under(str(root))
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"killed by pid after SIGTERM to the head: {left}"


def _config(tmp_path: Path, extra: str = "") -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(TASK + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"tasks: {tasks}\nout: {tmp_path / 'out'}\nrun_id: r\nsandbox: {{root: {tmp_path / 'sandboxes'}}}\n"
        f"{HARNESS}concurrency: {{workers: 1, sessions_per_worker: 1}}\n{extra}"
    )
    return config


@pytest.mark.integration
def test_without_an_address_the_run_starts_its_own_ray_beside_a_running_cluster(tmp_path, head):
    before = head.sessions()
    # What a bare ray.init() joins on this machine: the head's address file, found through RAY_TMPDIR.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = rollout_run(_config(tmp_path), {**env, "RAY_TMPDIR": str(head.temp_root)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "num_cpus and num_gpus must not be provided" not in proc.stderr
    assert read_table(tmp_path / "out" / "r").column("reward").to_pylist() == [1.0]

    own = head.sessions() - before
    assert len(own) == 1, "the run did not start a local Ray of its own"
    marker = str(own.pop())
    deadline = time.monotonic() + 30
    while processes_under(marker) and time.monotonic() < deadline:
        time.sleep(0.2)  # waiting for a condition, bounded
    assert not processes_under(marker), "its own Ray outlived the run"
    assert head.proc.poll() is None and _dashboard_up(head.dashboard), "the run touched the other cluster"
    assert not processes_under(str(tmp_path / "sandboxes"))


@pytest.mark.integration
def test_the_address_flag_wins_over_the_config_and_the_joined_cluster_stays_up(tmp_path, head):
    before = head.sessions()
    config = _config(tmp_path, "ray_address: local\n")
    proc = _rollout("run", str(config), "--address", head.gcs_address)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_table(tmp_path / "out" / "r").num_rows == 1
    assert head.sessions() == before, "started a cluster instead of joining the one --address names"
    assert head.proc.poll() is None and _dashboard_up(head.dashboard), "the run stopped a cluster it joined"


def _rollout(*args: str) -> subprocess.CompletedProcess[str]:
    """`rollout ARGS` in a fresh process, with no RAY_ADDRESS: only what ARGS name is joined."""
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )


def _submit(head: Head, job_dir: Path, submission_id: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`ray job submit --working-dir`, as a person runs it: Ray zips the directory, unpacks it on the
    node and runs the entrypoint there with RAY_ADDRESS set to this cluster."""
    return subprocess.run(
        [
            *(str(RAY), "job", "submit", "--address", head.dashboard, "--submission-id", submission_id),
            *("--working-dir", str(job_dir), "--", sys.executable, "-m", "executor.cli", "run", "cfg.yaml"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RAY_AUTH_MODE": "disabled", "COLUMNS": "300"},
    )


@pytest.mark.integration
def test_ray_job_submit_refuses_a_relative_out_and_writes_an_absolute_one(tmp_path, head):
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(head.dashboard)
    job_dir = _job_dir(tmp_path / "job", tmp_path / "sandboxes")

    _submit(head, job_dir, "relative-out")
    info = client.get_job_info("relative-out")
    assert info.status == JobStatus.FAILED and "exit code 2" in (info.message or ""), info
    logs = client.get_job_logs("relative-out")
    line = _one_error_line(logs)
    assert f"/{RUNTIME_ENV_DIR}/{WORKING_DIR_FILES}/" in line and REFUSED in line, line
    assert "absolute path on a filesystem the whole cluster shares" in line, line
    assert not (tmp_path / "sandboxes").exists()

    shared = tmp_path / "shared"
    before = _held_on_the_host()
    proc = _submit(head, job_dir, "absolute-out", "--out", str(shared), "--run-id", "demo-job")
    info = client.get_job_info("absolute-out")
    assert info.status == JobStatus.SUCCEEDED, (info, client.get_job_logs("absolute-out")[-3000:])
    assert proc.returncode == 0
    assert read_table(shared / "demo-job").column("reward").to_pylist() == [1.0]
    assert not processes_under(str(tmp_path / "sandboxes"))
    # The job's end kills its worker at once: what the worker holds on the host (its sandboxes' caps,
    # the servers kept for later sandboxes among them, and its gateway's socket) it gave back before.
    assert _held_on_the_host() - before == set()


def _held_on_the_host() -> set[str]:
    """The sandboxes' cgroups no process is in and the gateway sockets no worker answers on: what a
    worker killed before it closed leaves behind (a live sandbox's cgroup holds its server)."""

    def empty(group: Path) -> bool:
        try:
            return not (group / "cgroup.procs").read_text().strip()
        except OSError:  # removed meanwhile (another run's sandbox stopping)
            return False

    # Where the sandboxes' caps are made: v1's two hierarchies, or v2's one (both names the same).
    parents = {
        parent for c in (pidlimit.PIDS, pidlimit.MEMORY) if (parent := pidlimit._parent(c)) is not None
    }
    groups = [group for parent in parents for group in Path(parent).glob("*/") if empty(group)]
    # A gateway socket nobody accepts on, as the reaper tells a dead worker's.
    sockets = [
        sock
        for sock in Path(tempfile.gettempdir()).glob(f"{GATEWAY_SOCKET_PREFIX}*.sock")
        if not _answered(sock)
    ]
    return {str(path) for path in (*groups, *sockets)}


@pytest.mark.integration
def test_ray_job_stop_is_an_orderly_stop(tmp_path, head, gate_dir):
    """`ray job stop` sends the driver SIGTERM (and SIGKILL RAY_JOB_STOP_WAIT_TIME_S later): the
    sessions are cancelled and written, their sandboxes stopped, the summary says stopped."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    gate = gate_dir / "gate"
    agent = f"while [ ! -e {gate} ]; do sleep 0.1; done; touch done.txt; echo done"
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "tasks.jsonl").write_text("".join(TASK.replace("t0", f"t{i}") + "\n" for i in range(2)))
    (job_dir / "cfg.yaml").write_text(
        f"tasks: tasks.jsonl\nout: {tmp_path / 'shared'}\nrun_id: stopped-job\n"
        f"sandbox: {sandbox_yaml(tmp_path / 'sandboxes', gate)}\n"
        f"harness: {{name: command, command: {json.dumps(agent)}}}\n"
        "concurrency: {workers: 1, sessions_per_worker: 2}\n"
    )
    runtime_env = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "120"}})
    submit = subprocess.run(
        [
            *(
                str(RAY),
                "job",
                "submit",
                "--address",
                head.dashboard,
                "--submission-id",
                "to-stop",
                "--no-wait",
            ),
            *("--working-dir", str(job_dir), "--runtime-env-json", runtime_env),
            *("--", sys.executable, "-m", "executor.cli", "run", "cfg.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert submit.returncode == 0, submit.stderr[-3000:]
    client = JobSubmissionClient(head.dashboard)
    sandboxes = str(tmp_path / "sandboxes")
    deadline = time.monotonic() + 240
    while sum("while" in p for p in processes_under(sandboxes)) < 2:
        status = client.get_job_status("to-stop")
        assert status == JobStatus.RUNNING or status == JobStatus.PENDING, client.get_job_logs("to-stop")[
            -3000:
        ]
        assert time.monotonic() < deadline, "the job's sessions did not start"
        time.sleep(0.2)  # waiting for a condition, bounded
    stop = subprocess.run(
        [str(RAY), "job", "stop", "--address", head.dashboard, "to-stop"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert stop.returncode == 0, stop.stderr[-3000:]
    assert client.get_job_status("to-stop") == JobStatus.STOPPED
    logs = client.get_job_logs("to-stop")
    assert "run stopped: stopped by SIGTERM" in logs and "SIGTERM received" not in logs, logs[-3000:]
    run_dir = tmp_path / "shared" / "stopped-job"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["stopped_by"], summary["exit_code"]) == ("signal", 143)
    rows = read_table(run_dir).to_pylist()
    assert sorted((r["task_id"], r["failure_kind"], r["decision"]) for r in rows) == [
        ("t0", "cancelled", "retry"),
        ("t1", "cancelled", "retry"),
    ]
    assert all(r["node_id"] and r["sandbox_id"] for r in rows), rows
    assert not processes_under(sandboxes)
    assert head.proc.poll() is None and _dashboard_up(head.dashboard), "the stop touched the cluster"


@pytest.mark.integration
def test_gc_with_an_address_reaps_on_every_node_of_the_cluster(tmp_path, head):
    from tests.test_gc import _killed_owner_sandbox

    root = tmp_path / "sb"
    _killed_owner_sandbox(root, "s1", keep=False)
    config = tmp_path / "gc.yaml"
    config.write_text(f"tasks: {tmp_path / 'tasks.jsonl'}\nsandbox: {{root: {root}}}\n")
    gc = _rollout("gc", str(config), "--address", head.gcs_address)
    assert gc.returncode == 0, gc.stderr[-3000:]
    assert "ended local-s1" in gc.stdout and "local: 1 sandboxes ended" in gc.stdout, gc.stdout
    assert not (root / "crashed" / "s1").exists() and not processes_under(str(root))
    assert head.proc.poll() is None
