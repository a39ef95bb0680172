"""Whole runs through Ray on the container provider (real podman, real Codex): the demo tasks come to what
they come to on the local provider; Harbor task directories run as they are, each task in its own image,
rewards from their own tests, bad tasks failing in one line while the others go on, a Dockerfile built
once for all samples and retries; a SIGKILLed run's containers are gone after ``rollout gc``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from executor.store import read_table
from sandboxes.base import CONTROL_SUFFIX, REVIEW_SUFFIX
from sandboxes.container import list_containers
from sandboxes.testing.images import podman_usable
from tests.test_container import HOST_ARGS, builds_of, remove_built
from tests.test_run import assert_demo_outcomes

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(podman_usable() is not None, reason=str(podman_usable())),
    pytest.mark.usefixtures("test_images"),
]

REPO = Path(__file__).parents[1]
HARBOR = REPO / "tests" / "fixtures" / "harbor"
# The agent of the Harbor fixtures: it does what the instruction's RUN: line says.
FOLLOW_INSTRUCTION = "eval \"$(printf '%s\\n' \"$ROLLOUT_PROMPT\" | sed -n 's/^RUN: //p')\""
QUICK = {"retry": True, "max_attempts": 2, "backoff_base_s": 0.1, "backoff_cap_s": 0.2}


def write_config(tmp_path: Path, run_id: str, tasks: Path, **extra: object) -> Path:
    config = {
        "run_id": run_id,
        "tasks": str(tasks),
        "out": str(tmp_path / "out"),
        "sandbox": {"provider": "container", "root": str(tmp_path / "sandboxes"), **HOST_ARGS},
        "gateway": {"max_attempts_per_request": 3, "backoff_base_s": 0.1},
        "limits": {"deadline_s": 60, "grace_s": 3},
        "concurrency": {"workers": 1, "sessions_per_worker": 4},
        **extra,
    }
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def rollout(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_TMPDIR": "/tmp/rollout-ray-tests", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


@pytest.mark.usefixtures("codex_installed")
def test_demo_tasks_on_the_container_provider(tmp_path, test_images):
    rules = {"retry": True, "max_attempts": 2, "backoff_base_s": 0.2, "backoff_cap_s": 0.5}
    cfg = write_config(
        tmp_path,
        "demo-ctr",
        REPO / "examples" / "tasks.jsonl",
        policy={"rules": {"rate_limit_exceeded": rules, "model_timeout": rules}},
    )
    data = yaml.safe_load(cfg.read_text())
    data["sandbox"]["image"] = test_images.base
    cfg.write_text(yaml.safe_dump(data))
    proc = rollout("run", str(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_table(tmp_path / "out" / "demo-ctr").to_pylist()
    assert_demo_outcomes(rows)
    assert {r["sandbox_provider"] for r in rows} == {"container"}
    assert list_containers("podman", "demo-ctr") == []


def test_harbor_tasks_as_they_are(tmp_path):
    tasks = tmp_path / "harbor"
    shutil.copytree(HARBOR, tasks)
    # A context of this run's own, so that its one build happens here (the others' images are cached).
    nonce = uuid.uuid4().hex
    (tasks / "always-crashes" / "environment" / "nonce").write_text(nonce)
    cfg = write_config(
        tmp_path,
        "harbor",
        tasks,
        samples=4,
        harness={"name": "command", "command": FOLLOW_INSTRUCTION},
        policy={
            "rules": {
                "agent_crash": QUICK,
                "sandbox_start_failed": QUICK,
                # The agent here is a shell line: no model call is its normal way.
                "agent_no_model_call": {"retry": False, "grade": True, "final": "accept"},
            },
            "breaker": {"max_masked_fraction": None},
        },
    )
    proc = rollout("run", str(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_table(tmp_path / "out" / "harbor").to_pylist()
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(r)

    # Rewards from the tasks' own tests, each in its own image (write-greeting's test checks that the
    # marker image's file is absent, marker-image's that it is there).
    assert [r["reward"] for r in by_task["write-greeting"]] == [1.0] * 4
    assert [r["reward"] for r in by_task["marker-image"]] == [1.0] * 4
    # The agent wrote a reward of 1 and its own /tests/test.sh, and left a process rewriting the reward:
    # all gone before the task's tests ran.
    assert [r["reward"] for r in by_task["reward-hack"]] == [0.0] * 4
    assert all(r["verified"] for r in by_task["reward-hack"])

    crashes = by_task["always-crashes"]
    assert sorted((r["sample_index"], r["attempt"], r["decision"]) for r in crashes) == [
        (i, a, "retry" if a == 1 else "mask") for i in range(4) for a in (1, 2)
    ]
    # One build of its context for 4 samples and their retries.
    assert len(builds_of(tasks / "always-crashes" / "environment")) == 1
    remove_built(tasks / "always-crashes" / "environment")

    def one_line(task: str, kind: str, text: str) -> None:
        for r in by_task[task]:
            assert r["failure_kind"] == kind and text in r["error_message"], r["error_message"]
            assert "\n" not in r["error_message"]
        assert by_task[task][-1]["decision"] == "mask"

    one_line("missing-tests", "task_invalid", "Harbor task missing-tests: missing tests/test.sh")
    one_line("broken-dockerfile", "task_invalid", f"build of {tasks / 'broken-dockerfile'}")
    # The task's own failures, the same every time: one attempt per sample, never retried.
    for task in ("missing-tests", "broken-dockerfile"):
        assert sorted((r["sample_index"], r["attempt"]) for r in by_task[task]) == [(i, 1) for i in range(4)]
    one_line("missing-image", "sandbox_start_failed", "image 'localhost/rollout-no-such-image:1'")
    assert list_containers("podman", "harbor") == []


def test_sigkill_of_a_run_with_live_containers_then_gc(tmp_path, test_images):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "prompt": "wait", "image": test_images.marker}) + "\n"
            for i in range(2)
        )
    )
    cfg = write_config(tmp_path, "killed", tasks, harness={"name": "command", "command": "sleep 600"})
    env = {**os.environ, "RAY_TMPDIR": "/tmp/rollout-ray-tests", "PYTHONPATH": str(REPO)}
    run = subprocess.Popen(
        [sys.executable, "-m", "executor.cli", "run", str(cfg)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own group: the driver, its local Ray and the worker go together
    )
    owners: set[int] = set()
    try:

        def agents() -> list[tuple[str, dict[str, str]]]:
            # Each session's grading sandbox starts beside its agent's: the agents' are the ones counted.
            return [
                (name, labels)
                for name, labels in list_containers("podman", "killed")
                if not labels["rollout.session_id"].endswith((REVIEW_SUFFIX, CONTROL_SUFFIX))
            ]

        deadline = time.monotonic() + 180
        while len(agents()) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)  # polling for the containers to exist, bounded
        live = agents()
        assert len(live) == 2
        assert all(labels["rollout.run_id"] == "killed" for _name, labels in live)
        images = subprocess.run(
            ["podman", "inspect", "--format", "{{.ImageName}}", *[name for name, _labels in live]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert images.stdout.split() == [test_images.marker] * 2  # the tasks' image, not the run's
        # The worker holding the containers, named by their owner label; the driver's group first, so
        # that nothing starts another.
        owners = {int(labels["rollout.owner"].split("pid=")[1].split()[0]) for _name, labels in live}
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(60)
    for pid in owners:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in owners) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling for the SIGKILLed worker to be reaped by its parent, bounded
    gc = rollout("gc", str(cfg), timeout=300)
    assert gc.returncode == 0, gc.stderr[-2000:]
    assert list_containers("podman", "killed") == []


# A few scenarios for the CI; `rollout conformance --provider container` runs all 26 (docs/testing.md).
CONTAINER_SCENARIOS = ("tool_success", "transport_drop", "verifier_killed")


@pytest.mark.usefixtures("codex_installed", "pi_installed")
async def test_conformance_in_containers_for_codex_and_pi(tmp_path, test_images):
    from executor.testing.conformance import Target, parse_scenarios, run_matrix
    from sandboxes.container import ContainerSandboxConfig

    container = ContainerSandboxConfig(image=test_images.base, **HOST_ARGS)
    out = tmp_path / "conformance"
    matrix = await run_matrix(
        [Target("codex"), Target("pi")], parse_scenarios(CONTAINER_SCENARIOS), out, container=container
    )
    failed = [f"{c.harness} {c.scenario}: {c.first_failure}" for c in matrix.cells if not c.passed]
    assert len(matrix.cells) == 6 and not failed, failed
    assert "container (podman" in (out / "conformance.md").read_text()


CONFORMANCE = REPO / "tests" / "fixtures" / "harbor-conformance"
# Harbor's own example tasks this set stands for, and why those are not run here as they are.
NEEDS_WHAT_THIS_MACHINE_LACKS = {
    "hello-world": "FROM ubuntu:24.04 (a public registry pull), and its tests install uv and pytest "
    "from the network (allow_internet = true)",
    "hello-workdir": "FROM ubuntu:24.04 (a public registry pull)",
    "hello-user": "FROM ubuntu:24.04 (a public registry pull)",
    "shared-default": "FROM ubuntu:24.04 (a public registry pull)",
}


def with_solution_as_agent(tasks: Path) -> None:
    """Each task's solution/ baked into its image at /oracle, for the command harness to run as the
    agent: the agent never sees a solution in a real run."""
    for task in tasks.iterdir():
        shutil.copytree(task / "solution", task / "environment" / "oracle")
        with open(task / "environment" / "Dockerfile", "a") as f:
            f.write("\nCOPY oracle /oracle\n")


def test_harbor_conformance_set_with_solutions_as_agent(tmp_path):
    """Tasks after Harbor's own examples (hello-world, hello-workdir, hello-user, shared-default), in an
    image without python or git, their solutions as the agent: Harbor's reward for each; and one whose
    image ships its workspace (with git): the diff holds the agent's change only."""
    tasks = tmp_path / "tasks"
    shutil.copytree(CONFORMANCE, tasks)
    with_solution_as_agent(tasks)
    cfg = write_config(
        tmp_path,
        "harbor-conf",
        tasks,
        harness={"name": "command", "command": "bash /oracle/solve.sh"},
        policy={"rules": {"agent_no_model_call": {"retry": False, "grade": True, "final": "accept"}}},
    )
    proc = rollout("run", str(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["task_id"]: r for r in read_table(tmp_path / "out" / "harbor-conf").to_pylist()}
    assert sorted(rows) == sorted(p.name for p in CONFORMANCE.iterdir())
    for task in ("hello-world", "hello-workdir", "hello-user", "shared-default", "image-workdir"):
        r = rows[task]
        assert (r["reward"], r["verified"], r["decision"]) == (1.0, True, "accept"), (
            task,
            r["error_message"],
            r["verifier_stdout_tail"],
        )
        assert dict(r["rewards"]) == {"reward": 1.0}
    # The diff is against the workspace as the image gave it: the agent's edit, none of the image's files.
    diff = rows["image-workdir"]["workspace_diff"]
    assert "edit.txt" in diff and "+new" in diff and "-old" in diff and "kept.txt" not in diff, diff
    metrics = rows["many-metrics"]
    assert metrics["reward"] == 7.0 and dict(metrics["rewards"]) == {
        "reward": 7.0,
        "lines": 1.0,
        "penalty": -0.5,
    }
    assert metrics["verifier_stdout_tail"] == "counted 7\n"
    # /logs/agent kept as evidence: what the agent wrote there, as the task's user.
    with tarfile.open(Path(rows["hello-user"]["evidence_dir"]) / "harbor-logs.tar.gz") as tar:
        notes = tar.extractfile("logs/agent/notes.log")
        assert notes is not None and notes.read() == b"written by agent\n"
    assert list_containers("podman", "harbor-conf") == []


@pytest.mark.parametrize("user", [None, "nobody"], ids=["root", "nobody"])
async def test_in_a_container_model_calls_are_the_harness_s_whatever_its_user(tmp_path, test_images, user):
    """The container's forwarder tells the harness's connections from another process's (it reads every
    process's descriptors, another user's too): the harness's call is answered, its child's refused."""
    from executor.session import SessionRequest, run_session
    from executor.tasks import Task
    from harnesses.command import CommandHarness
    from tests.conftest import session_context
    from tests.test_reward_integrity import ASK_FROM_ANOTHER_PROCESS, FAILING_ENDPOINT, NO_BACKOFF

    spec = {"id": "t", "prompt": "p", "image": test_images.base, "model_script": FAILING_ENDPOINT}
    task = Task.model_validate({**spec, "user": user} if user else spec)
    harness = CommandHarness(command=f"python3 - <<'EOF'\n{ASK_FROM_ANOTHER_PROCESS}EOF\necho done")
    sandbox = {"provider": "container", "root": str(tmp_path / "sandboxes"), **HOST_ARGS}
    async with session_context(tmp_path, {**NO_BACKOFF, "sandbox": sandbox}, harness=harness) as ctx:
        row = await run_session(SessionRequest("calls", task, 0, 1), ctx)
    assert [call["request_index"] for call in row["model_calls"]] == [0], row["model_calls"]
    assert json.loads(row["error_detail"])["gateway"]["not_the_harness"] == 1, row["error_detail"]
    assert row["failure_kind"] == "none", (row["failure_kind"], row["error_message"])
