"""One rollout as a plain async function: sandbox, workspace, harness, classification, grading, row.

Tests call it without Ray; the worker actor is a thin host around it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from executor.config import RunConfig
from executor.tasks import Task
from harnesses.base import Harness, HarnessReport, Launch, LaunchContext
from harnesses.classify import classify
from harnesses.gateway import Gateway, GatewaySession
from harnesses.install import InstallError
from harnesses.scripted_model import ScriptedModel, parse_steps
from policy import FailureKind, Outcome, Status, bound_text
from sandboxes.base import (
    ExecResult,
    RunsBefore,
    Sandbox,
    SandboxLostError,
    SandboxProvider,
    SandboxSpec,
)
from sandboxes.prepared import PreparedWorkspaces
from sandboxes.workspace import diff_step, lay_out, read_diff, workspace_diff

log = logging.getLogger(__name__)

EVIDENCE_COPY_LIMIT = 16 * 1024 * 1024
MAX_DIFF_CHARS = 200_000


@dataclass(frozen=True)
class SessionRequest:
    run_id: str
    task: Task
    sample_index: int
    attempt: int

    @property
    def rollout_id(self) -> str:
        return rollout_id_of(self.task.id, self.sample_index, self.attempt)


def rollout_id_of(task_id: str, sample_index: int, attempt: int) -> str:
    return f"{task_id}.s{sample_index}.a{attempt}"


@dataclass
class SessionContext:
    config: RunConfig
    provider: SandboxProvider
    harness: Harness
    gateway: Gateway
    scripted: ScriptedModel | None
    evidence_root: Path
    cache_root: Path
    node_id: str = ""
    worker_id: str = ""
    # Workspaces laid out once per worker and copied in; None lays each out inside its sandbox.
    workspaces: PreparedWorkspaces | None = None
    install_dir: Path | None = None  # the harness's, once a session has found it installed

    async def ensure_installed(self) -> Path:
        """The harness's install directory, installing it the first time (in a thread: it may take
        minutes); later sessions of this worker skip the thread."""
        if self.install_dir is None:
            self.install_dir = await asyncio.to_thread(self.harness.ensure_installed, self.cache_root)
        return self.install_dir


class _Timer:
    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self._t = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.marks[name] = round(now - self._t, 4)
        self._t = now

    def since_lap(self) -> float:
        return round(time.monotonic() - self._t, 4)


async def run_session(req: SessionRequest, ctx: SessionContext) -> dict[str, Any]:
    """Run one attempt to the end and return its row (decision columns left for the driver)."""
    cfg = ctx.config
    started = datetime.now(UTC)
    timer = _Timer()
    evidence_dir = ctx.evidence_root / req.rollout_id
    evidence_dir.mkdir(parents=True, exist_ok=True)
    deadline = req.task.deadline_s or cfg.limits.deadline_s
    verify_timeout = req.task.verify.timeout_s if req.task.verify else 0.0
    row: dict[str, Any] = {
        "run_id": req.run_id,
        "rollout_id": req.rollout_id,
        "task_id": req.task.id,
        "sample_index": req.sample_index,
        "attempt": req.attempt,
        "harness": ctx.harness.name,
        "harness_version": ctx.harness.version,
        "version_tested": ctx.harness.version == ctx.harness.tested_version,
        "sandbox_provider": ctx.provider.name,
        "node_id": ctx.node_id,
        "worker_id": ctx.worker_id,
        "evidence_dir": str(evidence_dir),
        "started_at": started,
        "evidence_gaps": [],
    }
    spec = SandboxSpec(
        run_id=req.run_id,
        # Unique per launch, not per attempt: a resume reruns an attempt whose driver was killed before
        # its row was written, and that launch's sandbox directory may still be there.
        session_id=f"{req.rollout_id}.{secrets.token_hex(3)}",
        ttl_s=cfg.limits.setup_timeout_s + deadline + verify_timeout + 2 * cfg.limits.grace_s,
        workspace=req.task.workspace,
    )
    sandbox: Sandbox | None = None
    gw: GatewaySession | None = None
    outcome: Outcome
    try:
        try:
            sandbox = await ctx.provider.start(spec)
        except Exception as exc:
            timer.lap("setup")
            return _finish(row, Outcome.of(FailureKind.SANDBOX_START_FAILED, _err(exc)), timer)
        row["sandbox_id"] = sandbox.id
        if ctx.scripted is not None and req.task.model_script:
            ctx.scripted.set_script(req.rollout_id, parse_steps(req.task.model_script))
        gw = ctx.gateway.open_session(req.rollout_id, evidence_dir / "model")

        async def install_and_prepare(gw: GatewaySession) -> Launch:
            install_dir = await ctx.ensure_installed()
            context = LaunchContext(
                base_url=gw.base_url,
                api_key=gw.token,
                model=cfg.model.name,
                prompt=req.task.prompt,
                install_dir=install_dir,
                max_output_tokens=cfg.model.max_output_tokens,
            )
            return await ctx.harness.prepare(sandbox, context)

        try:
            # The harness's config goes to HOME while the workspace is laid out: neither reads the other.
            _, launch = await _gather_or_cancel(
                lay_out(sandbox, req.task.workspace, ctx.workspaces), install_and_prepare(gw)
            )
        except (InstallError, Exception) as exc:
            timer.lap("setup")
            return _finish(row, Outcome.of(FailureKind.SETUP_FAILED, _err(exc)), timer)
        timer.lap("setup")

        try:
            result = await sandbox.exec(
                launch.argv, timeout=deadline, env=launch.env, stdin=launch.stdin, name="harness"
            )
        except SandboxLostError as exc:
            timer.lap("agent")
            return _finish(row, Outcome.of(FailureKind.SANDBOX_LOST, _err(exc)), timer)
        ctx.gateway.close_session(gw)
        report = await ctx.harness.parse(sandbox, result)
        timer.lap("agent")
        outcome = classify(result, report, gw)
        _record_agent(row, result, report, gw)
        # The evidence copy reads the harness's files while the diff and the verifier use the workspace.
        evidence = asyncio.ensure_future(_keep_evidence(sandbox, result, report, evidence_dir, row))
        try:
            if cfg.policy.rule_for(outcome.failure_kind).grade and req.task.verify is not None:
                outcome = await _diff_and_grade(sandbox, req.task, outcome, row)
            else:
                await _record_diff(row, workspace_diff(sandbox))
            await evidence
        finally:
            evidence.cancel()  # only when the grading raised, or the session was cancelled
        timer.lap("verify")
        return _finish(row, outcome, timer)
    finally:
        if gw is not None:
            ctx.gateway.close_session(gw)
        if sandbox is not None:
            row["cleanup_ok"] = await _stop(sandbox)
            row["t_cleanup_s"] = timer.since_lap()
            row["t_total_s"] = round(sum(timer.marks.values()) + row["t_cleanup_s"], 4)


async def _gather_or_cancel(*steps: Awaitable[Any]) -> list[Any]:
    """``asyncio.gather``, except that the first failure cancels the other steps and waits for them:
    none may go on writing into a sandbox that is about to be stopped."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _record_diff(row: dict[str, Any], diff: Awaitable[str | None]) -> None:
    try:
        row["workspace_diff"] = bound_text(await diff, MAX_DIFF_CHARS)
    except Exception as exc:
        row["evidence_gaps"].append(f"workspace_diff_unavailable: {_err(exc)[:200]}")


async def _diff_and_grade(sandbox: Sandbox, task: Task, outcome: Outcome, row: dict[str, Any]) -> Outcome:
    """The diff, then the verifier: the diff holds the agent's changes and nothing of the verifier's.
    One exec where the sandbox can run a step before a command, else two."""
    assert task.verify is not None
    argv, timeout = ["bash", "-c", task.verify.command], task.verify.timeout_s
    one_exec = isinstance(sandbox, RunsBefore)
    if one_exec:
        verified = sandbox.exec(argv, timeout=timeout, name="verify", before=diff_step(sandbox.workdir))
    else:
        await _record_diff(row, workspace_diff(sandbox))
        verified = sandbox.exec(argv, timeout=timeout, name="verify")
    try:
        res = await verified
    except Exception as exc:
        if one_exec:
            row["evidence_gaps"].append(f"workspace_diff_unavailable: {_err(exc)[:200]}")
        return outcome.model_copy(
            update={"failure_kind": FailureKind.VERIFIER_ERROR, "error_message": _err(exc)}
        )
    if one_exec:
        await _record_diff(row, read_diff(sandbox, res.before))
    row["verifier_exit_code"] = res.exit_code
    if res.timed_out:
        message = f"verifier ran past {task.verify.timeout_s}s"
        return outcome.model_copy(
            update={"failure_kind": FailureKind.VERIFIER_TIMEOUT, "error_message": message}
        )
    row["verified"] = True
    row["reward"] = 1.0 if res.exit_code == 0 else 0.0
    return outcome


def _record_agent(row: dict[str, Any], result: ExecResult, report: HarnessReport, gw: GatewaySession) -> None:
    usage = report.usage
    # The gateway saw what the endpoint really reported; Codex prints 0 for usage it never received.
    input_tokens, output_tokens = _gateway_usage(gw)
    row.update(
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        final_text=report.final_text,
        messages=[m.model_dump() for m in report.messages],
        tool_calls=[t.model_dump() for t in report.tool_calls],
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cached_input_tokens=usage.cached_input_tokens,
        reasoning_tokens=usage.reasoning_tokens,
        model_attempts=[_attempt_row(a) for a in gw.attempts],
        stdout_tail=result.stdout_tail,
        stderr_tail=result.stderr_tail,
    )
    row["evidence_gaps"].extend(report.evidence_gaps)
    if input_tokens is None and "usage_unavailable" not in row["evidence_gaps"]:
        row["evidence_gaps"].append("usage_unavailable")


def _gateway_usage(gw: GatewaySession) -> tuple[int | None, int | None]:
    """Summed token counts of the answered attempts; unknown if any answered attempt lacked them."""
    # Model calls only: a GET (Hermes lists /models to look up prices) never carries usage.
    answered = [a for a in gw.attempts if a.kind is FailureKind.NONE and a.method != "GET"]
    if not answered:
        return None, None
    ins = [a.input_tokens for a in answered]
    outs = [a.output_tokens for a in answered]
    return (None if None in ins else sum(ins)), (None if None in outs else sum(outs))


def _attempt_row(attempt: Any) -> dict[str, Any]:
    data = attempt.model_dump(mode="json")
    keep = (
        "request_index",
        "attempt",
        "path",
        "started_at",
        "status",
        "kind",
        "error_message",
        "latency_s",
        "ttfb_s",
        "retry_after_s",
        "streamed",
        "response_bytes",
        "request_sha256",
        "input_tokens",
        "output_tokens",
        "finish_reason",
        "prompt_token_ids",
        "completion_token_ids",
        "completion_logprobs",
        "tokens_truncated",
    )
    return {k: data.get(k) for k in keep}


async def _keep_evidence(
    sandbox: Sandbox, result: ExecResult, report: HarnessReport, evidence_dir: Path, row: dict[str, Any]
) -> None:
    """Copy the harness's own streams and native transcript out of the sandbox, bounded and compressed."""
    sources = {
        "harness.stdout.gz": result.stdout_path,
        "harness.stderr.gz": result.stderr_path,
        "native_transcript.gz": report.native_transcript_path,
    }
    for name, path in sources.items():
        if not path:
            continue
        try:
            data = await sandbox.read_file(path, EVIDENCE_COPY_LIMIT)
        except Exception as exc:
            row["evidence_gaps"].append(f"{name}_unavailable: {_err(exc)[:200]}")
            continue
        await asyncio.to_thread((evidence_dir / name).write_bytes, gzip.compress(data, compresslevel=3))


async def _stop(sandbox: Sandbox) -> bool:
    try:
        await asyncio.wait_for(sandbox.stop(), timeout=30)
        return True
    except Exception as exc:
        log.warning("sandbox %s: cleanup failed: %s", sandbox.id, _err(exc))
        return False


def _finish(row: dict[str, Any], outcome: Outcome, timer: _Timer) -> dict[str, Any]:
    for phase in ("setup", "agent", "verify"):
        row[f"t_{phase}_s"] = timer.marks.get(phase)
    row.update(
        status=outcome.status.value,
        failure_kind=outcome.failure_kind.value,
        http_status=outcome.http_status,
        error_message=outcome.error_message,
        error_detail=json.dumps(outcome.error_detail, default=str)[:16_000],
        retry_after_s=outcome.retry_after_s,
    )
    if outcome.status is Status.FAILED or not row.get("verified"):
        row.setdefault("reward", None)
    return row


def _err(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return bound_text(f"{type(exc).__name__}: {text}", 4000) or ""


def lost_row(req: SessionRequest, harness: str, provider: str, message: str) -> dict[str, Any]:
    """The row of an attempt whose worker or node died: nothing of its evidence came back."""
    outcome = Outcome.of(FailureKind.SANDBOX_LOST, message)
    return {
        "run_id": req.run_id,
        "rollout_id": req.rollout_id,
        "task_id": req.task.id,
        "sample_index": req.sample_index,
        "attempt": req.attempt,
        "harness": harness,
        "sandbox_provider": provider,
        "status": outcome.status.value,
        "failure_kind": outcome.failure_kind.value,
        "error_message": outcome.error_message,
        "evidence_gaps": ["worker_lost"],
        "started_at": datetime.now(UTC),
    }
