"""The slurm provider against the real single-node Slurm that cluster/slurm/ci-start.sh brings up."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandboxes.base import SandboxSpec, SandboxStartError
from sandboxes.slurm import LIVE_STATES, SlurmSandboxConfig, job_state, list_jobs, reap_jobs
from tests.chaos.conftest import REPO, env, rollout, rows_of, write_config

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


def _agent_pid(root: str) -> int:
    return int(json.loads((Path(root) / "control" / "ready.json").read_text())["pid"])


async def test_a_job_that_cannot_start_its_agent_is_a_start_failure(tmp_path):
    provider = SlurmSandboxConfig(python="/nonexistent/python3", start_timeout_s=60).build(tmp_path / "sb")
    run_id = f"slurm-bad-{os.getpid()}"
    with pytest.raises(SandboxStartError, match="before its agent was ready"):
        await provider.start(SandboxSpec(run_id=run_id, session_id="s1", ttl_s=300))
    assert _jobs(run_id) == []


def test_jobs_of_a_dead_owner_are_reaped(tmp_path):
    run_id = f"slurm-reap-{os.getpid()}"
    # A stand-in worker: it starts a sandbox, reports the job, and is then SIGKILLed.
    code = (
        "import asyncio, sys; from pathlib import Path\n"
        "from sandboxes.base import SandboxSpec; from sandboxes.slurm import SlurmSandboxConfig\n"
        "async def main():\n"
        f"    p = SlurmSandboxConfig().build(Path({str(tmp_path / 'sb')!r}))\n"
        f"    s = await p.start(SandboxSpec(run_id={run_id!r}, session_id='s1', ttl_s=600))\n"
        "    print(s.descriptor()['job_id'], flush=True)\n"
        "    await asyncio.sleep(600)\n"
        "asyncio.run(main())\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        job_id = owner.stdout.readline().strip()  # type: ignore[union-attr]
        assert job_id and job_state(job_id) == "RUNNING"
        assert reap_jobs(run_id) == []  # its owner is alive: not ours to end
        owner.kill()
        owner.wait(10)
        assert reap_jobs(run_id) == [job_id]
        assert job_state(job_id) not in LIVE_STATES
        assert reap_jobs(run_id) == []  # idempotent
    finally:
        owner.kill()
        for job in _jobs(run_id):
            subprocess.run(["scancel", job], timeout=10, check=False)


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
