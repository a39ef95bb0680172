"""`rollout gc`: what a crashed run left, found and reaped on each provider, idempotently."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from sandboxes.base import SandboxSpec
from tests.conftest import processes_under

REPO = Path(__file__).parents[1]


def _gc(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", "gc", str(cfg), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def _config(tmp_path: Path, sandbox: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"tasks": str(tmp_path / "tasks.jsonl"), "sandbox": sandbox}))
    return path


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    cfg = _config(tmp_path, {"root": str(tmp_path / "sb")})
    proc = _gc(cfg, "--all")
    assert proc.returncode == 2 and "--all needs --run" in proc.stderr
    bad = _config(tmp_path, {"provider": "slurm", "partiton": "x"})
    proc = _gc(bad)
    assert proc.returncode == 2 and "sandbox.slurm.partiton" in proc.stderr


@contextlib.contextmanager
def _sandbox_owner(root: Path, session: str, *, keep: bool) -> Iterator[None]:
    """A stand-in worker that starts a sandbox and runs a long command in it, while the block runs;
    then it is SIGKILLed."""
    code = (
        "import asyncio; from pathlib import Path\n"
        "from sandboxes.base import SandboxSpec; from sandboxes.local import LocalSandboxProvider\n"
        "async def main():\n"
        f"    s = await LocalSandboxProvider(Path({str(root)!r}), keep={keep}).start(\n"
        f"        SandboxSpec(run_id='crashed', session_id={session!r}, ttl_s=600))\n"
        "    print('ready', flush=True)\n"
        "    await s.exec(['sleep', '600'], timeout=600)\n"
        "asyncio.run(main())\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert owner.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        yield
    finally:
        owner.kill()
        owner.wait(10)


def _killed_owner_sandbox(root: Path, session: str, *, keep: bool) -> None:
    """A sandbox whose owner process was SIGKILLed mid-command."""
    with _sandbox_owner(root, session, keep=keep):
        pass


def test_local_sandbox_of_a_killed_owner_is_reaped(tmp_path):
    root = tmp_path / "sb"
    cfg = _config(tmp_path, {"root": str(root)})
    with _sandbox_owner(root, "s1", keep=False):
        assert _gc(cfg, "--run", "crashed").stdout.strip().endswith("local: 0 sandboxes ended")
        assert (root / "crashed" / "s1" / "work").is_dir()  # its owner lives: left as it is
    proc = _gc(cfg, "--run", "crashed")
    assert proc.returncode == 0, proc.stderr
    assert "ended local-s1" in proc.stdout
    assert not (root / "crashed" / "s1").exists()  # the directory too: nobody will collect from it
    assert processes_under(str(root)) == []
    assert "local: 0 sandboxes ended" in _gc(cfg, "--run", "crashed").stdout  # idempotent


def test_a_kept_sandbox_directory_stays_and_a_live_owner_s_is_left(tmp_path):
    from sandboxes.local import reap_stale

    root = tmp_path / "sb"
    _killed_owner_sandbox(root, "kept", keep=True)
    _killed_owner_sandbox(root, "gone", keep=False)
    assert sorted(reap_stale(root)) == ["local-gone", "local-kept"]
    assert (root / "crashed" / "kept" / "work").is_dir()  # `keep: true` keeps it, as a stop would
    assert not (root / "crashed" / "kept" / "sandbox.json").exists()
    assert not (root / "crashed" / "gone").exists()
    assert processes_under(str(root)) == []


def test_empty_run_directories_and_dead_gateway_sockets_go_once_settled(tmp_path, monkeypatch):
    import socket
    import tempfile

    from executor import reaper

    root = tmp_path / "sb"
    old = time.time() - 2 * reaper.SETTLED_S
    for run in ("done", "replay-of-done", "fresh", "busy"):
        (root / run / "prepared-workspaces").mkdir(parents=True)
    (root / "busy" / "s1").mkdir()
    for path in [*root.glob("*/prepared-workspaces"), *root.glob("*")]:
        if "fresh" not in str(path):
            os.utime(path, (old, old))
    assert sorted(reaper.remove_empty_runs(root, "prepared-workspaces")) == [
        "busy/prepared-workspaces",
        "done",
        "done/prepared-workspaces",
        "replay-of-done",
        "replay-of-done/prepared-workspaces",
    ]
    assert sorted(p.name for p in root.iterdir()) == ["busy", "fresh"]
    assert (root / "busy" / "s1").is_dir()

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead, live, young = (tmp_path / f"{reaper.GATEWAY_SOCKET_PREFIX}{n}.sock" for n in ("1-a", "2-b", "3-c"))
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(live))
    listening.listen()
    for path in (dead, young):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
            gone.bind(str(path))  # bound, never listened on, closed: as a killed worker's
    for path in (dead, live):
        os.utime(path, (old, old))
    try:
        assert reaper.reap_gateway_sockets() == [str(dead)]
        assert live.exists() and young.exists() and not dead.exists()
    finally:
        listening.close()


def _slurm_up() -> bool:
    from tests.test_slurm import _slurm_up as up

    return up()


@pytest.mark.integration
@pytest.mark.skipif(not _slurm_up(), reason="no Slurm: run cluster/slurm/ci-start.sh (.ci/run does)")
async def test_slurm_jobs_of_a_run_are_reaped_with_all(tmp_path):
    from sandboxes.slurm import SlurmSandboxConfig, list_jobs

    run_id = f"gc-{os.getpid()}"
    cfg = _config(tmp_path, {"provider": "slurm", "root": str(tmp_path / "sb")})
    provider = SlurmSandboxConfig().build(tmp_path / "sb")
    sandbox = await provider.start(SandboxSpec(run_id=run_id, session_id="s1", ttl_s=600))
    job_id = sandbox.descriptor()["job_id"]
    try:
        # Its owner (this process) is alive: plain gc leaves it, --all ends it.
        assert "slurm: 0 sandboxes ended" in (await asyncio.to_thread(_gc, cfg, "--run", run_id)).stdout
        assert [j for j, _r, _f in list_jobs(run_id)] == [job_id]
        proc = await asyncio.to_thread(_gc, cfg, "--run", run_id, "--all")
        assert proc.returncode == 0, proc.stderr
        assert f"ended {job_id}" in proc.stdout
        assert list_jobs(run_id) == []
        again = await asyncio.to_thread(_gc, cfg, "--run", run_id, "--all")
        assert "slurm: 0 sandboxes ended" in again.stdout
    finally:
        await sandbox.stop()
