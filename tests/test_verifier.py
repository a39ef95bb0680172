"""The verifier's contract through ``run_session``: real local sandboxes, a real shell agent, real verifiers.

Exit 0 is 1.0 and any other exit 0.0, except the exits that say it could not grade (a signal, 126/127,
the reserved 125): those and a timeout are re-run in the same sandbox, then verifier_error /
verifier_timeout with no reward. A reward file, when written, is the reward.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from executor import grading
from executor.decisions import decide_row
from executor.grading import REWARD_FILE_VAR, VERIFIER_CANNOT_GRADE
from executor.session import SessionRequest, run_session
from executor.tasks import Task
from harnesses.command import CommandHarness
from sandboxes.base import SandboxSpec
from tests.conftest import processes_under, session_context

# The agent: one line appended per run (the verifiers below check it ran once), and a final answer.
AGENT = "echo ran >> agent-runs.txt; echo done"
# True only on a verifier's first run in this sandbox: it leaves a mark outside the workspace.
FIRST_RUN = 'test ! -e "$HOME/.verifier-ran" && touch "$HOME/.verifier-ran"'


async def _run(tmp_path: Path, verify: Any, attempt: int = 1) -> dict[str, Any]:
    task = Task.model_validate({"id": "v", "prompt": "p", "verify": verify})
    async with session_context(tmp_path) as ctx:
        ctx.harness = CommandHarness(command=AGENT)
        row = await run_session(SessionRequest("t", task, 0, attempt), ctx)
    assert (row["status"], row["cleanup_ok"]) == ("completed", True), row["error_message"]
    assert not processes_under(str(tmp_path / "sandboxes"))
    return row


def _decision(row: dict[str, Any]) -> str:
    from executor.config import RunConfig

    cfg = RunConfig.model_validate({"run_id": "t", "tasks": "none.jsonl"})
    verdict, _ = decide_row(row, 1, cfg.policy, budget_left=10, rng=random.Random(0))
    return verdict.decision.value


def _not_graded(row: dict[str, Any], kind: str = "verifier_error") -> None:
    assert row["failure_kind"] == kind, row["error_message"]
    assert row["reward"] is None and not row.get("verified")
    assert _decision(row) != "accept"  # retried, then masked: never a reward of 0


@pytest.mark.parametrize(
    ("verify", "runs"),
    [
        ("grep -qx ran agent-runs.txt", 1),
        ("exit 0", 1),
    ],
)
async def test_exit_0_is_1(tmp_path, verify, runs):
    row = await _run(tmp_path, verify)
    assert (row["failure_kind"], row["reward"], row["verified"]) == ("none", 1.0, True)
    assert (row["verifier_exit_code"], row["verifier_runs"]) == (0, runs)


@pytest.mark.parametrize("code", [1, 2, 124, 128, 255])
async def test_any_other_exit_is_a_real_zero(tmp_path, code):
    row = await _run(tmp_path, f"exit {code}")
    assert (row["failure_kind"], row["reward"], row["verified"]) == ("none", 0.0, True)
    assert (row["verifier_exit_code"], row["verifier_runs"]) == (code, 1)
    assert _decision(row) == "accept"


async def test_a_verifier_killed_by_sigkill_is_no_grade(tmp_path):
    row = await _run(tmp_path, "kill -KILL $$")
    _not_graded(row)
    assert row["verifier_exit_code"] is None and "signal 9" in row["error_message"]
    assert row["verifier_runs"] == 2  # re-run once (retries default 1), killed again


async def test_a_command_the_shell_reports_killed_is_no_grade(tmp_path):
    # bash runs the child and reports its SIGKILL as 128 + 9, as it does for an OOM-killed test runner.
    row = await _run(tmp_path, "bash -c 'kill -KILL $$'; exit $?")
    _not_graded(row)
    assert row["verifier_exit_code"] == 137 and "signal 9" in row["error_message"]


@pytest.mark.parametrize(
    ("verify", "code", "words"),
    [
        ("no-such-grader-xyz", 127, "could not run"),
        ("printf 'exit 0' > not-executable.sh && ./not-executable.sh", 126, "could not run"),
        (f"echo cannot reach the test database >&2; exit {VERIFIER_CANNOT_GRADE}", 125, "could not grade"),
    ],
)
async def test_exits_that_say_it_could_not_grade(tmp_path, verify, code, words):
    row = await _run(tmp_path, {"command": verify, "retries": 0})
    _not_graded(row)
    assert (row["verifier_exit_code"], row["verifier_runs"]) == (code, 1)
    assert words in row["error_message"] and len(row["error_message"]) < 4100
    if code == 125:
        assert "cannot reach the test database" in row["error_message"]


async def test_a_verifier_that_fails_to_run_once_then_grades(tmp_path):
    """verifier_flaky: the first run cannot start, the re-run in the same sandbox grades the agent's
    one run; the attempt is accepted, so the agent is not run again."""
    verify = (
        f"if {FIRST_RUN}; then echo flaky > flaky.txt; exit 127; fi; test $(wc -l < agent-runs.txt) -eq 1"
    )
    row = await _run(tmp_path, verify)
    assert (row["failure_kind"], row["reward"], row["verified"]) == ("none", 1.0, True), row["error_message"]
    assert (row["verifier_exit_code"], row["verifier_runs"]) == (0, 2)
    assert _decision(row) == "accept"
    # The diff is the agent's, taken once before the first run: nothing a verifier run wrote.
    assert "agent-runs.txt" in row["workspace_diff"] and "flaky" not in row["workspace_diff"]


async def test_a_verifier_past_its_timeout_is_re_run(tmp_path):
    verify = {"command": f"if {FIRST_RUN}; then exec sleep 600; fi; exit 0", "timeout_s": 1}
    row = await _run(tmp_path, verify)
    assert (row["failure_kind"], row["reward"], row["verifier_runs"]) == ("none", 1.0, 2), row[
        "error_message"
    ]


async def test_a_verifier_always_past_its_timeout_is_verifier_timeout(tmp_path):
    row = await _run(tmp_path, {"command": "exec sleep 600", "timeout_s": 1, "retries": 2})
    _not_graded(row, "verifier_timeout")
    assert row["verifier_runs"] == 3 and "past 1.0s" in row["error_message"]


@pytest.mark.parametrize(("content", "code", "reward"), [("0.25", 0, 0.25), (" 1\n", 1, 1.0), ("0", 0, 0.0)])
async def test_the_reward_file_is_the_reward(tmp_path, content, code, reward):
    verify = f'printf {content!r} > "${REWARD_FILE_VAR}"; exit {code}'
    row = await _run(tmp_path, verify)
    assert (row["failure_kind"], row["reward"], row["verified"]) == ("none", reward, True)
    assert REWARD_FILE_VAR not in (row["workspace_diff"] or "")


@pytest.mark.parametrize("content", ["lots", "1.5", "-0.1", "nan", "", "0.5 0.5", "x" * 5000])
async def test_an_invalid_reward_file_is_no_grade(tmp_path, content):
    verify = {"command": f'printf %s {content!r} > "${REWARD_FILE_VAR}"; exit 0', "retries": 0}
    row = await _run(tmp_path, verify)
    _not_graded(row)
    assert "reward file holds" in row["error_message"] and repr(content[:100]) in row["error_message"]
    assert len(row["error_message"]) < 400


async def test_an_earlier_run_s_reward_file_is_not_read_by_the_next(tmp_path):
    # The first run writes a valid reward and then cannot grade; the second writes none and exits 1.
    verify = f'if {FIRST_RUN}; then echo 1 > "${REWARD_FILE_VAR}"; exit 125; fi; exit 1'
    row = await _run(tmp_path, verify)
    assert (row["reward"], row["verifier_runs"]) == (0.0, 2)


async def test_a_sandbox_lost_while_verifying_reruns_the_agent(tmp_path):
    """The verifier cannot grade, and before its re-run the sandbox is gone (here: its descriptor, the
    sandbox's claim to exist, is removed as a reaper does): sandbox_lost, which reruns the agent."""
    verify = 'rm -f "$HOME/../sandbox.json"; exit 125'
    task = Task.model_validate({"id": "v", "prompt": "p", "verify": verify})
    # The verifier plays the reaper: only a sandbox that sees its own descriptor (isolation off) can.
    async with session_context(tmp_path, {"sandbox": {"isolation": "off"}}) as ctx:
        ctx.harness = CommandHarness(command=AGENT)
        row = await run_session(SessionRequest("t", task, 0, 1), ctx)
    assert (row["status"], row["failure_kind"]) == ("failed", "sandbox_lost"), row["error_message"]
    assert row["reward"] is None and row["verifier_runs"] == 2
    assert _decision(row) == "retry"
    assert not processes_under(str(tmp_path / "sandboxes"))


async def test_each_launch_of_an_attempt_gets_its_own_evidence_dir(tmp_path):
    """A resume reruns an attempt whose row was never written: the second launch must not write into the
    first one's directory. The row names the directory it used."""
    task = Task.model_validate({"id": "v", "prompt": "p", "verify": "exit 0"})
    async with session_context(tmp_path) as ctx:
        ctx.harness = CommandHarness(command=AGENT)
        first = await run_session(SessionRequest("t", task, 0, 3), ctx)
        second = await run_session(SessionRequest("t", task, 0, 3), ctx)
    assert first["rollout_id"] == second["rollout_id"] == "v.s0.a3"
    assert (first["reward"], second["reward"]) == (1.0, 1.0), (
        first["error_message"],
        second["error_message"],
    )
    dirs = [Path(first["evidence_dir"]), Path(second["evidence_dir"])]
    assert dirs[0] != dirs[1] and all(d.parent == tmp_path / "evidence" for d in dirs)
    assert all(d.name.startswith("v.s0.a3.") for d in dirs)
    for d in dirs:
        assert (d / "harness.stdout.gz").is_file() and (d / "model").is_dir()


async def test_a_grading_sandbox_begins_beside_its_harness_only_once_no_other_session_is_setting_up(tmp_path):
    """A run's first wave starts a worker's sessions at once: their set-ups are on their rollouts' paths,
    a grading sandbox begun beside a harness is not, so it waits until none is setting up. A session that
    ended without a sandbox (its start failed) no longer counts as setting up."""
    task = Task.model_validate({"id": "v", "prompt": "p", "verify": "true"})
    async with session_context(tmp_path) as ctx:

        def review(name: str) -> grading.Review:
            return grading.Review(
                ctx.provider, SandboxSpec(run_id="t", session_id=name, ttl_s=60), task, None
            )

        first, second = review("first"), review("second")
        first.begin_beside_harness()
        assert not first.began  # the second is still setting up
        second.begin_beside_harness()
        assert second.began
        failed = review("failed")
        await failed.close()  # as a session whose sandbox never started closes it
        third = review("third")
        third.begin_beside_harness()
        assert third.began
        assert await asyncio.gather(first.close(), second.close(), third.close()) == [True, True, True]
    assert not processes_under(str(tmp_path / "sandboxes"))
