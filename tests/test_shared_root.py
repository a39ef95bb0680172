"""Runs that share one sandbox root never touch each other, even when one of them sees another PID
namespace (a run inside a container, a second job on a Slurm node): a reaper's proof that an owner is
gone is a lock the owner held until its death, which crosses PID namespaces where a pid does not."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from executor.store import read_table
from sandboxes.isolation import pid_namespace_unavailable
from tests.chaos.conftest import wait_until
from tests.conftest import ended, processes_under

REPO = Path(__file__).parents[1]
ROLLOUTS = 10
SLOTS = 4  # the first run's sessions held at its gate while the second run starts, reaps and ends


def _own_pid_namespace_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "a PID namespace with its own /proc (unshare --pid --fork --mount-proc) needs root"
    return pid_namespace_unavailable()


needs_pid_namespace = pytest.mark.skipif(
    _own_pid_namespace_unavailable() is not None, reason=str(_own_pid_namespace_unavailable())
)


def in_own_pid_namespace(argv: list[str]) -> list[str]:
    """``argv`` as pid 1 of a PID namespace of its own with its own /proc: it sees none of our pids,
    and its processes (and those of everything it starts) end with it."""
    return ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *argv]


# -- one owner, one reaper, in different PID namespaces ----------------------------------------------------

OWNER = """
import asyncio, sys
from pathlib import Path
from sandboxes.base import SandboxSpec, WorkspaceSpec
from sandboxes.local import LocalSandboxProvider
from sandboxes.prepared import PreparedWorkspaces
from sandboxes.workspace import lay_out

async def main() -> None:
    root = Path(sys.argv[1])
    sandbox = await LocalSandboxProvider(root).start(SandboxSpec(run_id="owned", session_id="s1", ttl_s=600))
    await lay_out(sandbox, WorkspaceSpec(files={"a.txt": "a"}), PreparedWorkspaces(root, "owned"))
    print(sandbox.descriptor()["owner"], flush=True)
    await sandbox.exec(["sleep", "600"], timeout=600)

asyncio.run(main())
"""

# What a worker's reaper does at its start (executor/reaper.py), with what each part removed.
REAP = """
import json, sys
from pathlib import Path
from sandboxes.local import reap_stale
from sandboxes.owner import forget_dead
from sandboxes.prepared import reap_prepared

root = Path(sys.argv[1])
prepared = reap_prepared(root)
sandboxes = reap_stale(root)
print(json.dumps({"prepared": prepared, "sandboxes": sandboxes, "records": forget_dead(root)}))
"""


def python(code: str, *args: str, own_pid_namespace: bool = False) -> list[str]:
    argv = [sys.executable, "-c", code, *args]
    return in_own_pid_namespace(argv) if own_pid_namespace else argv


def dead_owner(root: Path) -> str:
    """The name of an owner record under ``root`` whose process has exited: its lock is free."""
    code = "import sys, pathlib; from sandboxes.owner import hold; print(hold(pathlib.Path(sys.argv[1])))"
    proc = subprocess.run(
        python(code, str(root)), capture_output=True, text=True, timeout=60, cwd=REPO, check=True
    )
    return proc.stdout.strip()


def reap(root: Path, *, own_pid_namespace: bool) -> dict[str, list[str]]:
    proc = subprocess.run(
        python(REAP, str(root), own_pid_namespace=own_pid_namespace),
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def holders(path: Path) -> list[int]:
    """The processes (as this PID namespace numbers them) with ``path`` open."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd")):
                found.append(int(pid))
    return found


NOTHING: dict[str, list[str]] = {"prepared": [], "sandboxes": [], "records": []}


@needs_pid_namespace
@pytest.mark.parametrize("inside", ["owner", "reaper"], ids=["owner-inside", "reaper-inside"])
def test_a_reaper_in_another_pid_namespace_leaves_a_live_owner_alone_and_reaps_a_dead_one(
    tmp_path: Path, inside: str
) -> None:
    root = tmp_path / "sandboxes"
    owner = subprocess.Popen(
        python(OWNER, str(root), own_pid_namespace=inside == "owner"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
    )  # fmt: skip
    try:
        name = (owner.stdout.readline() if owner.stdout else "").strip()  # once its sandbox's command runs
        assert name, owner.stderr.read() if owner.stderr and owner.poll() is not None else "no owner name"
        record = root / "owners" / name
        descriptor = root / "owned" / "s1" / "sandbox.json"
        prepared = root / "owned" / "prepared-workspaces" / name
        # Only the owner holds its record: nothing the sandbox runs inherited it, or it would outlive us.
        holding = holders(record)
        assert len(holding) == 1
        assert reap(root, own_pid_namespace=inside == "reaper") == NOTHING
        assert descriptor.exists() and prepared.is_dir() and record.exists()
        assert owner.poll() is None  # its command still runs
    finally:
        os.killpg(owner.pid, signal.SIGKILL)  # with unshare --kill-child, the namespace goes with it
        owner.wait()

    # Inside its own namespace the owner is not our child: unshare's end does not wait for it.
    assert all(ended(pid, bound_s=60) for pid in holding)
    assert holders(record) == []
    reaped = reap(root, own_pid_namespace=inside == "reaper")
    assert reaped == {
        "prepared": [f"owned/prepared-workspaces/{name}"],
        "sandboxes": ["local-s1"],
        "records": [name],
    }
    assert not descriptor.exists() and not prepared.exists() and not record.exists()
    assert processes_under(str(root)) == []
    assert reap(root, own_pid_namespace=inside == "reaper") == NOTHING


def test_a_missing_or_foreign_record_and_a_dead_owner(tmp_path: Path) -> None:
    """Dead: a record whose lock is free, or none at all (one goes only after its owner). Never dead
    here: this process, another machine's owner, an unreadable record, a name that is no owner's."""
    from sandboxes import owner

    me, gone, missing = owner.hold(tmp_path), dead_owner(tmp_path), "0123456789abcdef"
    assert me == owner.hold(tmp_path)  # one record per process and root
    foreign = "fedcba9876543210"
    (tmp_path / "owners" / foreign).write_text(
        json.dumps({"host": "elsewhere", "boot": "x", "pid": "1", "ticks": "1"})
    )
    torn = "00000000000000ff"
    (tmp_path / "owners" / torn).write_text("{")
    # An owner that could not lock its record (a filesystem without locks) is never proven dead by one.
    unlocked = "00000000000000fe"
    record = json.loads((tmp_path / "owners" / gone).read_text()) | {"locked": False}
    (tmp_path / "owners" / unlocked).write_text(json.dumps(record))
    names = (me, gone, missing, foreign, torn, unlocked, "s1")
    assert [owner.known_dead(tmp_path, n) for n in names] == [False, True, True, False, False, False, False]
    assert owner.forget_dead(tmp_path) == [gone]
    assert owner.forget_dead(tmp_path) == []
    assert sorted(p.name for p in (tmp_path / "owners").iterdir()) == sorted([me, foreign, torn, unlocked])


FORKS = """
import os, sys, pathlib
from sandboxes.owner import hold
print(hold(pathlib.Path(sys.argv[1])), flush=True)
if os.fork() == 0:
    print("child", flush=True)
    sys.stdin.read()  # lives on until the test closes its stdin
"""


def test_a_forked_child_does_not_keep_its_dead_parent_alive(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        python(FORKS, str(tmp_path)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        name, child = proc.stdout.readline().strip(), proc.stdout.readline().strip()
        assert child == "child"
        assert proc.wait(60) == 0  # the parent, the record's owner, is gone; its child lives on
        from sandboxes import owner

        assert owner.known_dead(tmp_path, name)
    finally:
        proc.stdin.close()


def test_a_record_removed_from_under_its_owner_is_made_again(tmp_path: Path) -> None:
    from sandboxes import owner

    first = owner.hold(tmp_path)
    shutil.rmtree(tmp_path / "owners")  # the root deleted while the process lives
    second = owner.hold(tmp_path)
    assert second != first and not owner.known_dead(tmp_path, second)


@pytest.fixture
def ray_tmps() -> Iterator[tuple[Path, Path]]:
    """A Ray temp dir for each run, short (Ray's socket paths must fit in 107 bytes): two local clusters."""
    paths = (
        Path(tempfile.mkdtemp(prefix="rr-a-", dir="/tmp")),
        Path(tempfile.mkdtemp(prefix="rr-b-", dir="/tmp")),
    )
    yield paths
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _marks(tmp_path: Path) -> Path:
    """Where the gated run's sessions say they wait: a directory bound into their view, writable, as
    their own workspaces are a disk mounted in their run's mount namespace (unseen from outside it)."""
    marks = tmp_path / "waiting"
    marks.mkdir(mode=0o777, exist_ok=True)
    marks.chmod(0o777)  # the sandboxes' own uids write there
    return marks


def _config(tmp_path: Path, run_id: str, gate: Path | None) -> Path:
    # The gated run's sessions say they are in the agent step, then wait there until the test opens the
    # gate: its sandboxes and its laid-out workspaces are live while the other run's worker reaps.
    marks = _marks(tmp_path)
    wait = (
        f"mktemp -p {marks} >/dev/null; i=0; while [ ! -e {gate} ] && [ $i -lt 3000 ]; "
        "do sleep 0.1; i=$((i+1)); done; "
        if gate
        else ""
    )
    mounts = [{"path": str(gate.parent)}, {"path": str(marks), "writable": True}] if gate else []
    tasks = tmp_path / f"{run_id}.jsonl"
    with tasks.open("w") as fh:
        for i in range(ROLLOUTS):
            task = {
                "id": f"t{i}",
                "prompt": "Copy greeting.txt to hello.txt",
                # Inline files: the worker lays the workspace out once and copies it into each sandbox.
                "workspace": {"files": {"greeting.txt": f"hello {i}\n"}},
                "verify": f"grep -qx 'hello {i}' hello.txt",
            }
            fh.write(json.dumps(task) + "\n")
    cfg = {
        "tasks": str(tasks),
        "out": str(tmp_path / "out"),
        "run_id": run_id,
        # The same root for both runs; the gate's directory in the view (it shows the host by allow-list).
        "sandbox": {
            "root": str(tmp_path / "sandboxes"),
            "mounts": mounts,
        },
        "harness": {"name": "command", "command": wait + "cat greeting.txt > hello.txt; echo done"},
        "limits": {"deadline_s": 400},
        "concurrency": {"workers": 1, "sessions_per_worker": SLOTS},
    }
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _start(argv: list[str], ray_tmp: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(ray_tmp)}
    with log.open("wb") as err:
        return subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=REPO, start_new_session=True
        )


def _finish(proc: subprocess.Popen[bytes], log: Path, bound_s: float = 600) -> None:
    try:
        proc.wait(bound_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    lines = [line for line in log.read_text(errors="replace").splitlines() if not line.startswith('{"event"')]
    assert proc.returncode == 0, "\n".join(lines)[-3000:]


def _rows(tmp_path: Path, run_id: str) -> list[dict[str, Any]]:
    return read_table(tmp_path / "out" / run_id).to_pylist()


@pytest.mark.integration
@pytest.mark.timeout(900)  # two runs, each with a Ray cluster of its own, on a machine shared with others
@needs_pid_namespace
@pytest.mark.parametrize("inside", ["first", "second"], ids=["first-run-inside", "second-run-inside"])
def test_two_runs_on_one_root_one_in_its_own_pid_namespace_lose_nothing(
    tmp_path: Path, ray_tmps: tuple[Path, Path], inside: str, gate_dir: Path
) -> None:
    """The first run holds its sessions (sandboxes, laid-out workspaces) live while the second run's
    worker starts, reaps at its start-up, runs and ends; then the first run finishes. Either run may be
    the one in a PID namespace of its own: each reaper sees pids the other's owner does not have."""
    gate = gate_dir / "gate"  # where the sandboxes see it: /tmp (and so tmp_path) is hidden from them
    first_cfg, second_cfg = _config(tmp_path, "first", gate), _config(tmp_path, "second", None)
    root = tmp_path / "sandboxes"

    def argv(cfg: Path, which: str) -> list[str]:
        cli = [sys.executable, "-m", "executor.cli", "run", str(cfg)]
        return in_own_pid_namespace(cli) if which == inside else cli

    first_log, second_log = tmp_path / "first.stderr", tmp_path / "second.stderr"
    first = _start(argv(first_cfg, "first"), ray_tmps[0], first_log)
    try:
        marks = _marks(tmp_path)
        assert wait_until(lambda: len(list(marks.iterdir())) == SLOTS, 300, first), first_log.read_text(
            errors="replace"
        )[-3000:]
        second = _start(argv(second_cfg, "second"), ray_tmps[1], second_log)
        _finish(second, second_log)
    finally:
        gate.touch()
    _finish(first, first_log)

    for run_id in ("first", "second"):
        rows = _rows(tmp_path, run_id)
        seen = sorted((r["task_id"], r["attempt"], r["decision"]) for r in rows)
        accepted = sum(r["final"] and r["decision"] == "accept" for r in rows)
        kinds = Counter(r["failure_kind"] for r in rows if r["decision"] != "accept")
        print(
            f"TWO-RUNS inside={inside} run={run_id} rows={len(rows)} accepted={accepted} other={dict(kinds)}"
        )
        assert seen == [(f"t{i}", 1, "accept") for i in range(ROLLOUTS)], [
            (r["rollout_id"], r["failure_kind"], (r["error_message"] or "")[:300]) for r in rows
        ]
    assert processes_under(str(root)) == []
