"""Chaos in our own processes: a worker actor killed mid-run, the driver killed three times, sandbox
starts failing, the output disk filling up."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from executor.store import part_files
from sandboxes.testing.faults import failures_in
from tests.chaos.conftest import (
    OK_SCRIPT,
    REPO,
    env,
    figures,
    report,
    rollout,
    rows_of,
    run,
    wait_no_leaks,
    wait_until,
    write_config,
    write_tasks,
)
from tests.conftest import processes_under

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("codex_installed")]


def _start(cfg: Path) -> subprocess.Popen[bytes]:
    log = cfg.with_suffix(".stderr")  # read by _stderr_of when an assertion needs to say why
    return subprocess.Popen(
        rollout("run", str(cfg)),
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),
        env=env(),
        cwd=REPO,
        start_new_session=True,
    )


def _stderr_of(cfg: Path) -> str:
    log = cfg.with_suffix(".stderr")
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(line for line in lines if not line.startswith('{"event"'))[-3000:]


def _pids_under(marker: str) -> list[int]:
    return [int(line.split(":", 1)[0]) for line in processes_under(marker)]


def _ray_worker_of(pid: int) -> int | None:
    """Walk up from a sandbox process to the Ray actor process hosting its session."""
    for _ in range(20):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        if cmdline.startswith(b"ray::"):
            return pid
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            return None
    return None


def _hanging_sessions(sandboxes: Path, marker: str) -> set[str]:
    """Session directories with a live harness process (the command's own ``sleep``) in them."""
    found = set()
    for line in processes_under(str(sandboxes)):
        pid = int(line.split(":", 1)[0])
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if marker in line and cwd.startswith(str(sandboxes)):
            parts = cwd[len(str(sandboxes)) :].strip("/").split("/")  # <run_id>/<session_id>/work
            if len(parts) >= 2:
                found.add(parts[1])
    return found


def test_sigkill_of_a_worker_actor_with_20_sessions_loses_and_leaks_nothing(tmp_path, gate_dir):
    n = 20
    released = gate_dir / "released"
    # The `command` harness: each session hangs until the test releases it, so all 20 are surely running
    # at the kill however loaded the machine is, and the resubmitted attempts finish at once.
    command = f"while [ ! -e {released} ]; do sleep 0.5; done; echo ok > out.txt; echo done"
    tasks = write_tasks(tmp_path / "tasks.jsonl", n, lambda i: OK_SCRIPT)
    cfg = write_config(
        tmp_path,
        "workerkill",
        tasks,
        harness={"name": "command", "command": command},
        concurrency={"workers": 1, "sessions_per_worker": n},
        limits={"deadline_s": 300, "grace_s": 3},
        gates=gate_dir,
    )
    sandboxes = tmp_path / "sandboxes"
    driver = _start(cfg)
    try:
        hanging = wait_until(lambda: len(_hanging_sessions(sandboxes, "sleep")) >= n, 300, driver)
        assert hanging, _stderr_of(cfg)
        workers = {_ray_worker_of(pid) for pid in _pids_under(str(sandboxes))} - {None}
        assert len(workers) == 1, workers
        os.kill(workers.pop(), signal.SIGKILL)
        assert wait_until(lambda: not _hanging_sessions(sandboxes, "sleep"), 120), "killed sessions lived on"
        released.touch()
        assert driver.wait(timeout=300) == 0
    finally:
        released.touch()
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=60)
    rows = rows_of(tmp_path, "workerkill")
    fig = figures(rows, {(f"t{i:03d}", 0) for i in range(n)})
    lost = [r for r in rows if r["failure_kind"] == "sandbox_lost"]
    leaks = wait_no_leaks(str(sandboxes))
    report("worker-sigkill", f"{n}sessions/1worker", len(lost), fig["lost"], fig["dup"], leaks)
    assert fig == {"lost": 0, "dup": 0} and leaks == 0
    assert len(lost) == n and all(r["attempt"] == 1 and r["decision"] == "retry" for r in lost)
    assert all("worker" in (r["error_message"] or "") for r in lost)
    final = [r for r in rows if r["final"]]
    assert all((r["attempt"], r["failure_kind"], r["decision"]) == (2, "none", "accept") for r in final), [
        (r["attempt"], r["failure_kind"], r["error_message"]) for r in final
    ]
    shutil.rmtree(sandboxes, ignore_errors=True)


def test_three_sigkills_of_the_driver_then_the_same_dataset_as_an_uninterrupted_run(tmp_path, gate_dir):
    n = 16
    slow = {0, 2}  # time out at their 4 s deadline: graded partial work, the same in every run
    gates = [gate_dir / f"gate{g}" for g in range(4)]  # task i waits for gates[i // 4]; gate 0 is open

    def script(i: int) -> list[dict]:
        if i in slow:
            return [{"type": "shell", "command": "sleep 600"}]
        # Bounded by the task's deadline; the gate holds the run open until the test lets it progress.
        hold = f"while [ ! -e {gates[i // 4]} ]; do sleep 0.2; done"
        return [{"type": "shell", "command": hold}, *OK_SCRIPT]

    tasks_path = tmp_path / "tasks.jsonl"
    write_tasks(tasks_path, n, script, deadline_s=240)
    tasks = [json.loads(line) for line in tasks_path.read_text().splitlines()]
    for i in slow:
        tasks[i]["deadline_s"] = 4
    tasks_path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    gates[0].touch()
    concurrency = {"workers": 1, "sessions_per_worker": n}
    cfg = write_config(tmp_path, "driverkill", tasks_path, concurrency=concurrency, gates=gate_dir)
    rows_dir = tmp_path / "out" / "driverkill" / "rows"
    rng = random.Random()
    kills = 0
    seen_parts = 0
    # Round k opens gate k: that group's rows are fresh progress, and the groups still gated keep the run
    # from finishing, so every round ends in a kill at a random point after its progress.
    for gate in gates[1:]:
        driver = _start(cfg)
        try:
            progressed = wait_until(lambda seen=seen_parts: len(part_files(rows_dir)) > seen, 240, driver)
            assert progressed and driver.poll() is None, _stderr_of(cfg)
            time.sleep(rng.uniform(0, 3))  # the fault point itself is random; nothing waits on it
            assert driver.poll() is None, _stderr_of(cfg)
            os.killpg(driver.pid, signal.SIGKILL)
            kills += 1
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=60)
        seen_parts = len(part_files(rows_dir))
        assert wait_no_leaks(str(tmp_path / "sandboxes"), 180) == 0, processes_under(
            str(tmp_path / "sandboxes")
        )
        gate.touch()
    final_run = run(cfg)
    assert final_run.returncode == 0, final_run.stderr[-2000:]
    rows = rows_of(tmp_path, "driverkill")  # reads every part whole: none is torn
    assert not list(rows_dir.glob("*.tmp"))
    fig = figures(rows, {(f"t{i:03d}", 0) for i in range(n)})
    leaks = wait_no_leaks(str(tmp_path / "sandboxes"))
    report(
        "driver-sigkill", f"{n}tasks", kills, fig["lost"], fig["dup"], leaks, parts=len(part_files(rows_dir))
    )
    assert kills == 3
    assert fig == {"lost": 0, "dup": 0} and leaks == 0
    # What an uninterrupted run yields, sample by sample: the script decides each outcome.
    final = {r["task_id"]: r for r in rows if r["final"]}
    for i in range(n):
        r = final[f"t{i:03d}"]
        want = ("agent_timeout", "accept") if i in slow else ("none", "accept")
        assert (r["failure_kind"], r["decision"]) == want, (i, r["error_message"])
        assert r["reward"] == (0.0 if i in slow else 1.0)  # the agent timed out: partial work graded


def test_thirty_percent_of_sandbox_starts_fail_then_retry_then_mask(tmp_path):
    n, fraction = 10, 0.3
    tasks = write_tasks(tmp_path / "tasks.jsonl", n, lambda i: OK_SCRIPT)
    cfg = write_config(tmp_path, "flaky", tasks, sandbox={"inject_start_failures": fraction})
    proc = run(cfg)
    rows = rows_of(tmp_path, "flaky")
    fig = figures(rows, {(f"t{i:03d}", 0) for i in range(n)})
    leaks = wait_no_leaks(str(tmp_path / "sandboxes"))
    failed = [r for r in rows if r["failure_kind"] == "sandbox_start_failed"]
    report(
        "sandbox-start-30pct", f"{n}tasks", len(failed), fig["lost"], fig["dup"], leaks, attempts=len(rows)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert fig == {"lost": 0, "dup": 0} and leaks == 0
    assert failed, "no start failed: the fault was not injected"
    assert len(failed) == failures_in(len(rows), fraction)  # one worker: one count of starts
    for r in rows:
        if r["failure_kind"] == "sandbox_start_failed":
            assert r["reward"] is None and not r["sandbox_id"]
            assert r["decision"] == ("retry" if r["attempt"] == 1 else "mask")
        else:
            assert (r["decision"], r["reward"]) == ("accept", 1.0)


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "out"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_output_disk_stops_the_run_cleanly_and_the_next_run_resumes(tmp_path, small_disk):
    n = 24
    tasks = write_tasks(tmp_path / "tasks.jsonl", n, lambda i: OK_SCRIPT)
    cfg = write_config(tmp_path, "full", tasks)
    full = run(cfg)
    rows_dir = small_disk / "full" / "rows"
    written = rows_of(tmp_path, "full")  # whatever was written reads whole
    assert full.returncode != 0, "the disk never filled: make the tmpfs smaller"
    stop_lines = [line for line in full.stderr.splitlines() if "run stopped:" in line]
    assert len(stop_lines) == 1 and "No space left on device" in stop_lines[0], full.stderr[-3000:]
    assert "Traceback" not in full.stderr, full.stderr[-3000:]
    print(stop_lines[0])
    assert not list(rows_dir.glob("*.tmp"))
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = run(cfg)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = rows_of(tmp_path, "full")
    fig = figures(rows, {(f"t{i:03d}", 0) for i in range(n)})
    leaks = wait_no_leaks(str(tmp_path / "sandboxes"))
    report("disk-full", f"{n}tasks/400k", 1, fig["lost"], fig["dup"], leaks, rows_before=len(written))
    assert fig == {"lost": 0, "dup": 0} and leaks == 0
    assert {(r["rollout_id"]) for r in written} <= {r["rollout_id"] for r in rows}
