"""The slurm provider against the real single-node Slurm that cluster/slurm/ci-start.sh brings up."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from sandboxes import uidpool
from sandboxes.base import SandboxSpec, SandboxStartError
from sandboxes.owner import Owner
from sandboxes.slurm import (
    COMMENT_MAX,
    LIVE_STATES,
    SlurmSandboxConfig,
    _comment,
    _parse_comment,
    job_state,
    list_jobs,
    reap_jobs,
)
from tests.chaos.conftest import REPO, env, rollout, rows_of, write_config
from tests.conftest import ended
from tests.test_shared_root import holders, needs_pid_namespace, python

REPO_ROOT = Path(__file__).parents[1]


def _slurm_up() -> bool:
    if not shutil.which("sinfo") or not shutil.which("sbatch"):
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mix", "alloc"))


pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not _slurm_up(), reason="no Slurm here: run cluster/slurm/ci-start.sh (as .ci/run does)"
    ),
]


def _wait(condition, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)  # polling a condition, bounded
    return bool(condition())


def _jobs(run_id: str) -> list[str]:
    return [job for job, _run, _fields in list_jobs(run_id)]


async def test_start_exec_files_stop_and_no_job_left(tmp_path):
    provider = SlurmSandboxConfig().build(tmp_path / "sb")
    run_id = f"slurm-unit-{os.getpid()}"
    sandbox = await provider.start(SandboxSpec(run_id=run_id, session_id="s1", ttl_s=300))
    job_id = sandbox.descriptor()["job_id"]
    try:
        assert sandbox.id == f"slurm-{job_id}"
        assert job_state(job_id) == "RUNNING" and _jobs(run_id) == [job_id]
        control = Path(sandbox.root) / "control"
        assert stat.S_IMODE((control / "token").stat().st_mode) == 0o600
        token = (control / "token").read_text()
        shown = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%o %j %k %Z"], capture_output=True, text=True, timeout=10
        ).stdout
        assert f"rollout.{run_id}" in shown and token not in shown
        assert token not in Path(f"/proc/{_agent_pid(sandbox.root)}/cmdline").read_text()

        # The agent runs as the job's step; the command sees the scrubbed environment, not the job's.
        agent_parent = Path(f"/proc/{_agent_pid(sandbox.root)}/stat").read_text().rsplit(")", 1)[1].split()[1]
        assert b"slurmstepd" in Path(f"/proc/{agent_parent}/cmdline").read_bytes()
        result = await sandbox.exec(["bash", "-c", 'echo "${SLURM_JOB_ID:-none}"; pwd'], timeout=30)
        assert result.exit_code == 0
        assert result.stdout_tail.split() == ["none", sandbox.workdir]
        await sandbox.write_file("dir/data.bin", bytes(range(256)) * 10)
        assert await sandbox.read_file("dir/data.bin", 1 << 20) == bytes(range(256)) * 10
    finally:
        await sandbox.stop()
    assert job_state(job_id) not in LIVE_STATES
    assert _jobs(run_id) == []
    assert not Path(sandbox.root).exists()  # keep is off


async def test_a_tasks_image_runs_the_agent_through_apptainer(tmp_path):
    provider = SlurmSandboxConfig(keep=True, start_timeout_s=60).build(tmp_path / "sb")
    run_id = f"slurm-image-{os.getpid()}"
    with pytest.raises(SandboxStartError, match="before its agent was ready"):
        # No apptainer on this machine: the job says so; what it ran is what is checked.
        await provider.start(SandboxSpec(run_id=run_id, session_id="s1", ttl_s=300, image="docker://task:1"))
    job = (tmp_path / "sb" / run_id / "s1" / "control" / "job.sh").read_text()
    assert "exec apptainer exec --bind" in job and " docker://task:1 python3 " in job
    with pytest.raises(SandboxStartError, match=r"needs sandbox\.provider 'container'"):
        await provider.start(SandboxSpec(run_id=run_id, session_id="s2", ttl_s=300, build_context="/x"))
    assert _jobs(run_id) == []


# A hostile command: everything it prints is what it could get at.
HOSTILE = """
id -u; id -G
cat /etc/munge/munge.key {home}/.aws/credentials {home}/.ray/auth_token {root}/../s2/control/token
ls /tmp/rollout-slurm {sandboxes}
cat /proc/{worker}/environ | tr '\\0' '\\n' | grep -F SECRET
python3 - {other} {gateway} <<'PY'
import socket, sys, urllib.request
for port in sys.argv[1:-1] + ["6817", "6818"]:
    try:
        socket.create_connection(("127.0.0.1", int(port)), timeout=3).close()
        print("connected", port)
    except OSError as exc:
        print("refused", port, exc.errno)
print(urllib.request.urlopen(sys.argv[-1], timeout=10).read().decode())
PY
echo planted > /etc/planted-{tag}; echo planted > {home}/planted; echo mine > mine && echo wrote mine
"""


class _Gateway(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"the gateway answered"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


async def test_a_hostile_command_gets_nothing_of_the_node(tmp_path):
    """The default isolation on the node: the command runs as the unprivileged user, sees neither the
    munge key, nor homes, nor another session's token, nor the node's processes, and reaches the
    worker's gateway (relayed by its agent) and no other port of the host."""
    home = Path(
        tempfile.mkdtemp(prefix="rollout-slurm-home-", dir="/home" if os.access("/home", os.W_OK) else None)
    )
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text("aws_secret_access_key = SECRET-aws\n")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("SECRET-ray")
    worker = subprocess.Popen(["sleep", "300"], env={"PATH": os.environ["PATH"], "KEY": "SECRET-key"})
    other = socket.create_server(("127.0.0.1", 0))  # a port of the host's, as Ray's GCS would be
    ports = [other.getsockname()[1], 6817, 6818]  # and slurmctld's, slurmd's
    gateway = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    provider = SlurmSandboxConfig().build(tmp_path / "sb")
    run_id = f"slurm-hostile-{os.getpid()}"
    spec = SandboxSpec(run_id=run_id, session_id="s1", ttl_s=300)
    a, b = await asyncio.gather(
        provider.start(spec), provider.start(spec.model_copy(update={"session_id": "s2"}))
    )
    try:
        assert a.isolation_label == "network,pids,filesystem,user"
        url = a.gateway_url(f"http://127.0.0.1:{gateway.server_address[1]}/s/token/v1")
        assert url == f"http://127.0.0.1:{gateway.server_address[1]}/s/token/v1"
        script = HOSTILE.format(
            home=home, root=a.root, sandboxes=tmp_path / "sb", worker=worker.pid, tag=run_id,
            other=ports[0], gateway=url,
        )  # fmt: skip
        res = await a.exec(["bash", "-c", script], timeout=60)
        other_uid = (await b.exec(["id", "-u"], timeout=60)).stdout_tail.strip()
        token = (Path(b.root) / "control" / "token").read_text()
    finally:
        await asyncio.gather(a.stop(), b.stop())
        worker.kill()
        worker.wait()
        other.close()
        gateway.shutdown()
        shutil.rmtree(home, ignore_errors=True)
    out = res.stdout_tail + res.stderr_tail
    uid, groups, *_ = res.stdout_tail.splitlines()
    # A uid of the node's pool (its gid the same number), not the other job's on the node: no signal
    # crosses between them.
    assert int(uid) >= uidpool.POOL_BASE and groups == uid and other_uid != uid, (out, other_uid)
    assert "SECRET" not in out and token not in out, out
    for gone in ("/etc/munge/munge.key", f"{home}/.aws", "/tmp/rollout-slurm", str(tmp_path / "sb")):
        assert f"{gone}" in res.stderr_tail, (gone, out)  # named in "No such file or directory"
    assert f"/proc/{worker.pid}/environ: No such file" in res.stderr_tail, out
    assert [line for line in res.stdout_tail.splitlines() if line.startswith(("refused", "connected"))] == [
        f"refused {p} 111" for p in ports
    ], out
    assert "the gateway answered" in res.stdout_tail, out
    assert "wrote mine" in res.stdout_tail and not Path(f"/etc/planted-{run_id}").exists()
    assert not (home / "planted").exists()


def _agent_pid(root: str) -> int:
    return int(json.loads((Path(root) / "control" / "ready.json").read_text())["pid"])


async def test_a_job_that_cannot_start_its_agent_is_a_start_failure(tmp_path):
    provider = SlurmSandboxConfig(python="/nonexistent/python3", start_timeout_s=60).build(tmp_path / "sb")
    run_id = f"slurm-bad-{os.getpid()}"
    with pytest.raises(SandboxStartError, match="before its agent was ready"):
        await provider.start(SandboxSpec(run_id=run_id, session_id="s1", ttl_s=300))
    assert _jobs(run_id) == []


# A stand-in worker: it starts a sandbox, reports the job, and waits to be SIGKILLed.
OWNER = """
import asyncio, sys
from pathlib import Path
from sandboxes.base import SandboxSpec
from sandboxes.slurm import SlurmSandboxConfig

async def main() -> None:
    provider = SlurmSandboxConfig().build(Path(sys.argv[1]))
    sandbox = await provider.start(SandboxSpec(run_id=sys.argv[2], session_id="s1", ttl_s=600))
    print(sandbox.descriptor()["job_id"], flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""

# What a worker's reaper does with Slurm jobs at its start (executor/reaper.py).
REAP = """
import json, sys
from pathlib import Path
from sandboxes.slurm import reap_jobs
print(json.dumps(reap_jobs(Path(sys.argv[1]), sys.argv[2])))
"""


def _reap(root: Path, run_id: str, *, own_pid_namespace: bool) -> list[str]:
    proc = subprocess.run(
        python(REAP, str(root), run_id, own_pid_namespace=own_pid_namespace),
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    "inside",
    [
        None,
        pytest.param("owner", marks=needs_pid_namespace),
        pytest.param("reaper", marks=needs_pid_namespace),
    ],
    ids=["one-pid-namespace", "owner-inside", "reaper-inside"],
)
def test_jobs_of_a_dead_owner_are_reaped(tmp_path: Path, inside: str | None) -> None:
    """Either side may see a PID namespace of its own (a run in a container, a second job on a node):
    the owner's pid in the job's comment then names nobody in the reaper's /proc, or somebody else; the
    lock on its record under the shared root tells."""
    run_id = f"slurm-reap-{os.getpid()}-{inside}"
    root = tmp_path / "sb"
    owner = subprocess.Popen(
        python(OWNER, str(root), run_id, own_pid_namespace=inside == "owner"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        job_id = (owner.stdout.readline() if owner.stdout else "").strip()
        assert job_id, owner.stderr.read() if owner.stderr and owner.poll() is not None else "no job"
        assert job_state(job_id) == "RUNNING"
        (fields,) = [f for job, _run, f in list_jobs(run_id) if job == job_id]
        assert fields["record"] in os.listdir(root / "owners")
        holding = holders(root / "owners" / fields["record"])
        assert holding
        assert _reap(root, run_id, own_pid_namespace=inside == "reaper") == []  # a live owner's: not ours
        assert job_state(job_id) == "RUNNING"
        os.killpg(owner.pid, signal.SIGKILL)  # with unshare --kill-child, the namespace goes with it
        owner.wait(10)
        # Inside its own namespace the owner is not our child: unshare's end does not wait for it.
        assert all(ended(pid, bound_s=60) for pid in holding)
        assert _reap(root, run_id, own_pid_namespace=inside == "reaper") == [job_id]
        assert job_state(job_id) not in LIVE_STATES
        assert _reap(root, run_id, own_pid_namespace=inside == "reaper") == []  # idempotent
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()
        for job in _jobs(run_id):
            subprocess.run(["scancel", job], timeout=10, check=False)


def test_a_job_of_an_older_version_is_left_to_its_ttl(tmp_path: Path) -> None:
    """An older version's comment names its owner by pid alone, which proves nothing in a reaper that
    may see another PID namespace: a pid gone from our /proc does not end the job; its TTL does."""
    run_id = f"slurm-legacy-{os.getpid()}"
    me = Owner.current()
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    comment = _comment(Owner(me.host, me.boot, int(exited.stdout), 1), time.time() + 600)
    assert "record=" not in comment
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--job-name=rollout.{run_id}", "--time=10", f"--comment={comment}",
         "--output=/dev/null", f"--chdir={tmp_path}", "--wrap=sleep 600"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        assert _wait(lambda: job_state(job_id) == "RUNNING", 60)
        assert reap_jobs(tmp_path, run_id) == []
        assert reap_jobs(tmp_path, run_id, now=time.time() + 601) == [job_id]
    finally:
        subprocess.run(["scancel", job_id], timeout=10, check=False)


def test_the_comment_fits_slurms_limit_at_its_longest() -> None:
    longest = Owner("h" * 64, "abcdef01", 4_194_304, 2**63, "0123456789abcdef")  # Linux's longest host name
    assert len(_comment(longest, 10**12)) <= COMMENT_MAX
    assert Owner.decode(_parse_comment(_comment(longest, 10**12))) == longest


CODEX_TASKS = ("hello-file", "fix-add", "rate-limit-recovers")


@pytest.mark.usefixtures("codex_installed")
def test_demo_tasks_with_provider_slurm_and_real_codex(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    lines = (REPO / "examples" / "tasks.jsonl").read_text().splitlines()
    tasks.write_text("".join(line + "\n" for line in lines if json.loads(line)["id"] in CODEX_TASKS))
    run_id = f"slurm-demo-{os.getpid()}"
    cfg = write_config(
        tmp_path, run_id, tasks, sandbox={"provider": "slurm", "root": str(tmp_path / "sandboxes")}
    )
    proc = subprocess.run(
        rollout("run", str(cfg)), capture_output=True, text=True, timeout=600, env=env(), cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(tmp_path, run_id)
    final = {r["task_id"]: r for r in rows if r["final"]}
    assert set(final) == set(CODEX_TASKS)
    for task, r in final.items():
        assert (r["status"], r["failure_kind"], r["reward"], r["decision"]) == (
            "completed",
            "none",
            1.0,
            "accept",
        ), (task, r["error_message"])
        assert r["sandbox_provider"] == "slurm" and r["sandbox_id"].startswith("slurm-")
        # Codex ran as the sandbox user, in the agent's namespaces, reaching the gateway through its relay.
        assert r["sandbox_isolation"] == "network,pids,filesystem,user"
        assert r["cleanup_ok"] is True
    recovered = final["rate-limit-recovers"]["model_calls"]
    assert recovered[0]["status"] == 429 and recovered[1]["status"] == 200
    assert len({r["sandbox_id"] for r in rows}) == len(rows)
    assert _jobs(run_id) == []


@pytest.mark.usefixtures("codex_installed")
def test_sigkill_of_a_worker_actor_leaves_no_slurm_job(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    with tasks.open("w") as fh:
        for i in range(3):
            # The agent's own command outlives the deadline: the session stays up until then.
            script = [{"type": "shell", "command": "sleep 600"}]
            task = {"id": f"t{i}", "prompt": "wait", "model_script": script}
            fh.write(json.dumps({**task, "deadline_s": 8, "verify": "true"}) + "\n")
    run_id = f"slurm-kill-{os.getpid()}"
    cfg = write_config(
        tmp_path,
        run_id,
        tasks,
        sandbox={"provider": "slurm", "root": str(tmp_path / "sandboxes")},
        concurrency={"workers": 1, "sessions_per_worker": 3},
    )
    driver = subprocess.Popen(
        rollout("run", str(cfg)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env(),
        cwd=REPO,
        start_new_session=True,
    )
    try:
        # Three sessions with their Codex running in Slurm jobs, all owned by the one worker actor.
        assert _wait(lambda: len(_codex_sessions(tmp_path / "sandboxes")) == 3, 240), "sessions never ran"
        owners = {fields["pid"] for _job, _run, fields in list_jobs(run_id)}
        assert len(owners) == 1
        first_jobs = set(_jobs(run_id))
        os.kill(int(owners.pop()), signal.SIGKILL)
        # The driver reaps the dead worker's jobs as soon as it hears of the death.
        assert _wait(lambda: not first_jobs & set(_jobs(run_id)), 90), "jobs of the dead worker left"
        assert driver.wait(timeout=300) == 0
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=60)
        for job in _jobs(run_id):
            subprocess.run(["scancel", job], timeout=10, check=False)
    rows = rows_of(tmp_path, run_id)
    lost = [r for r in rows if r["failure_kind"] == "sandbox_lost"]
    assert len(lost) == 3 and all(r["attempt"] == 1 and r["decision"] == "retry" for r in lost)
    final = [r for r in rows if r["final"]]
    assert sorted(r["task_id"] for r in final) == ["t0", "t1", "t2"]
    assert all((r["attempt"], r["failure_kind"]) == (2, "agent_timeout") for r in final)
    assert _jobs(run_id) == []


def _codex_sessions(root: Path) -> set[str]:
    """Sessions whose Codex process is running (found by its working directory under ``root``)."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cwd.startswith(str(root)) and b"codex" in cmdline:
            found.add(cwd)
    return found


async def test_on_a_node_model_calls_are_the_harness_s(tmp_path):
    """The agent's forwarder of each command tells the harness's connections from another process's (the
    agent's PID namespace is the sandbox's) and relays the latter to the gateway's other port, where
    the call is refused: the harness's call is answered, its child's never goes upstream."""
    from executor.session import SessionRequest, run_session
    from executor.tasks import Task
    from harnesses.command import CommandHarness
    from tests.conftest import session_context
    from tests.test_reward_integrity import ASK_FROM_ANOTHER_PROCESS, FAILING_ENDPOINT, NO_BACKOFF

    task = Task.model_validate({"id": "t", "prompt": "p", "model_script": FAILING_ENDPOINT})
    harness = CommandHarness(command=f"python3 - <<'EOF'\n{ASK_FROM_ANOTHER_PROCESS}EOF\necho done")
    sandbox = {"provider": "slurm", "root": str(tmp_path / "sandboxes")}
    async with session_context(tmp_path, {**NO_BACKOFF, "sandbox": sandbox}, harness=harness) as ctx:
        row = await run_session(SessionRequest("calls", task, 0, 1), ctx)
    assert row["sandbox_isolation"] == "network,pids,filesystem,user"
    assert [call["request_index"] for call in row["model_calls"]] == [0], row["model_calls"]
    assert json.loads(row["error_detail"])["gateway"]["not_the_harness"] == 1, row["error_detail"]
    assert row["failure_kind"] == "none", (row["failure_kind"], row["error_message"])
