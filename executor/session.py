"""One rollout as a plain async function: sandbox, workspace, harness, classification, grading, row.

Tests call it without Ray; the worker actor is a thin host around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import secrets
import shutil
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from executor import grading, harbor
from executor.config import RunConfig
from executor.grading import describe
from executor.row import Message, ModelCall, Row, ToolCall
from executor.storage import Location, describe_error
from executor.tasks import Task
from harnesses.base import Harness, HarnessReport, Launch, LaunchContext
from harnesses.classify import classify
from harnesses.gateway import GatewaySession
from harnesses.install import InstallError
from policy import FailureKind, Outcome, Status
from sandboxes.base import (
    EndsCommands,
    ExecResult,
    Sandbox,
    SandboxLostError,
    SandboxProvider,
    SandboxSpec,
    SandboxStartError,
    StartsInMilliseconds,
    StopsOnEvent,
)
from sandboxes.inline import small_inline
from sandboxes.prepared import PreparedWorkspaces
from sandboxes.workspace import lay_out

# The gateway's server (aiohttp) is the worker's to import, not a driver's; the scripted model is test
# machinery that only a run with the scripted provider has.
if TYPE_CHECKING:
    from harnesses.gateway import Gateway
    from harnesses.testing.scripted_model import ScriptedModel

log = logging.getLogger(__name__)

EVIDENCE_COPY_LIMIT = 16 * 1024 * 1024
# A launch's evidence put to the run's object store: tries, the pause before the second (doubling), and
# the bound on each try; the SDK retries each request within a try too.
EVIDENCE_UPLOAD_TRIES = 3
EVIDENCE_UPLOAD_PAUSE_S = 0.5
EVIDENCE_UPLOAD_TIMEOUT_S = 120.0
DEADLINE_STALL_SHARE = 0.25
AGENT_TIME_TICK_S = 0.05  # the shortest wait of the agent-time watch
# How long a harness whose gateway session was closed may take to end on its own before it is stopped.
CLOSED_SESSION_GRACE_S = 2.0
# Launch directories of one rollout id: a fresh random tag each, so this many collisions never happen.
EVIDENCE_DIR_TRIES = 16


@dataclass(frozen=True)
class SessionRequest:
    run_id: str
    task: Task
    sample_index: int
    attempt: int
    policy_version: int | None = None  # the trainer's version when the driver sent it (executor/api.py)

    @property
    def rollout_id(self) -> str:
        return rollout_id_of(self.task.id, self.sample_index, self.attempt)


def rollout_id_of(task_id: str, sample_index: int, attempt: int) -> str:
    return f"{task_id}.s{sample_index}.a{attempt}"


def launch_dir(evidence_root: Path, rollout_id: str) -> str:
    """A new directory under ``evidence_root`` for one launch of ``rollout_id``, made here and named
    ``<rollout_id>.<random tag>``; the name is returned (the sandbox's session id too). A resume reruns
    an attempt whose row was never written: its launch gets a directory of its own, never the earlier
    launch's, which may hold that launch's files. The row's ``evidence_dir`` names the one used."""
    evidence_root.mkdir(parents=True, exist_ok=True)
    for _ in range(EVIDENCE_DIR_TRIES):
        name = f"{rollout_id}.{secrets.token_hex(3)}"
        try:
            (evidence_root / name).mkdir()
        except FileExistsError:
            continue
        return name
    raise FileExistsError(f"{evidence_root}: no free launch directory for {rollout_id}")


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
    # Where a launch's evidence goes once its session ends, when the run is not on this node's disk (the
    # run's evidence/ on an object store); the row names it there. None: it stays in evidence_root.
    evidence_store: Location | None = None
    worker_id: str = ""
    # Workspaces laid out once per worker and copied in; None lays each out inside its sandbox.
    workspaces: PreparedWorkspaces | None = None
    install_dir: Path | None = None  # the harness's, once a session has found it installed
    # Each running session's row and phase marks by rollout id, as far as they are filled: what the
    # worker tells the driver, which writes it on a row the session never returns (executor/placement.py).
    live: dict[str, tuple[Row, dict[str, float]]] | None = None

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
    """Run one attempt to the end and return its row's columns (decision columns left for the driver)."""
    launch_id = launch_dir(ctx.evidence_root, req.rollout_id)
    try:
        row = await _run(req, ctx, launch_id)
    finally:
        if ctx.live is not None:
            ctx.live.pop(req.rollout_id, None)
    if ctx.evidence_store is not None:
        await ship_evidence(row, ctx.evidence_root / launch_id, ctx.evidence_store / launch_id)
    return row.to_dict()


async def ship_evidence(row: Row, local: Path, dest: Location) -> None:
    """Put a launch's evidence from this node's scratch to the run's storage, in a thread (never on the
    loop the gateway serves from), bounded and retried; then remove the scratch copy. What could not be
    put is an evidence gap on the row: the row itself is kept."""
    try:
        for attempt in range(EVIDENCE_UPLOAD_TRIES):
            try:
                await asyncio.wait_for(asyncio.to_thread(dest.upload_tree, local), EVIDENCE_UPLOAD_TIMEOUT_S)
                return
            except (OSError, TimeoutError) as exc:
                if attempt + 1 == EVIDENCE_UPLOAD_TRIES:
                    cause = "timed out" if isinstance(exc, TimeoutError) else describe_error(exc)
                    row.evidence_gaps.append(f"evidence_upload_failed: {cause[:200]}")
                    log.warning("evidence of %s not put to %s: %s", row.rollout_id, dest, cause)
                    return
                await asyncio.sleep(EVIDENCE_UPLOAD_PAUSE_S * 2**attempt)
    finally:
        await asyncio.to_thread(shutil.rmtree, local, True)
        # The scratch root too once no launch is in it: a worker of a joined cluster is never closed, it
        # ends with the job. On the loop, so no launch directory is made meanwhile (launch_dir is too).
        with contextlib.suppress(OSError):
            local.parent.rmdir()


async def _run(req: SessionRequest, ctx: SessionContext, launch_id: str) -> Row:
    cfg = ctx.config
    started = datetime.now(UTC)
    timer = _Timer()
    evidence_dir = ctx.evidence_root / launch_id
    deadline = req.task.deadline_s or cfg.limits.deadline_s
    wall = cfg.limits.wall_s(deadline)
    verify = req.task.verify
    verify_timeout = verify.timeout_s * (verify.retries + 1) if verify else 0.0
    row = Row(
        run_id=req.run_id,
        rollout_id=req.rollout_id,
        task_id=req.task.id,
        sample_index=req.sample_index,
        attempt=req.attempt,
        policy_version=req.policy_version,
        harness=ctx.harness.name,
        harness_version=ctx.harness.version,
        version_tested=ctx.harness.version == ctx.harness.tested_version,
        sandbox_provider=ctx.provider.name,
        sandbox_isolation=ctx.provider.isolation_label,
        node_id=ctx.node_id,
        worker_id=ctx.worker_id,
        evidence_dir=str(ctx.evidence_store / launch_id if ctx.evidence_store else evidence_dir),
        started_at=started,
    )
    if ctx.live is not None:
        ctx.live[req.rollout_id] = (row, timer.marks)
    spec = SandboxSpec(
        run_id=req.run_id,
        # Unique per launch, not per attempt: a resume reruns an attempt whose driver was killed before
        # its row was written, and that launch's sandbox directory may still be there.
        session_id=launch_id,
        ttl_s=cfg.limits.setup_timeout_s + wall + verify_timeout + 2 * cfg.limits.grace_s,
        workspace=req.task.workspace,
        **req.task.sandbox_request(),
    )
    sandbox: Sandbox | None = None
    gw: GatewaySession | None = None
    outcome: Outcome
    review = grading.Review(
        ctx.provider, spec, harbor.with_reward_key(req.task, cfg.reward_key), ctx.workspaces
    )
    try:
        if req.task.invalid is not None:
            timer.lap("setup")
            return _finish(row, Outcome.of(FailureKind.TASK_INVALID, req.task.invalid), timer)
        try:
            sandbox = await ctx.provider.start(spec)
        except Exception as exc:
            timer.lap("setup")
            kind = (
                FailureKind.TASK_INVALID
                if isinstance(exc, SandboxStartError) and exc.task_fault
                else FailureKind.SANDBOX_START_FAILED
            )
            return _finish(row, Outcome.of(kind, describe(exc)), timer)
        row.sandbox_id = sandbox.id
        if not isinstance(ctx.provider, StartsInMilliseconds):
            # A start that takes a while (a container, a job) is made beside the agent's run, not after it.
            review.begin()
        # A remote sandbox's layers are made on its node, and known once its agent has answered.
        row.sandbox_isolation = sandbox.isolation_label or row.sandbox_isolation
        if ctx.scripted is not None and req.task.model_script:
            from harnesses.testing.scripted_model import parse_steps

            ctx.scripted.set_script(req.rollout_id, parse_steps(req.task.model_script))
        gw = ctx.gateway.open_session(
            req.rollout_id,
            evidence_dir / "model",
            version=req.policy_version,
            one_client=cfg.harness.model_client == "one_process",
        )

        async def install_and_prepare(gw: GatewaySession) -> Launch:
            install_dir = await ctx.ensure_installed()
            # Where the harness's commands reach the gateway: a remote sandbox's own network reaches it
            # only at 127.0.0.1, through its agent (which relays its other processes' to the other port).
            reach = sandbox.gateway_url
            context = LaunchContext(
                base_url=reach(gw.base_url, ctx.gateway.other_port) if reach is not None else gw.base_url,
                api_key=gw.token,
                model=(gw.route.model if gw.route is not None else None) or cfg.model.name,
                prompt=req.task.prompt,
                install_dir=install_dir,
                max_output_tokens=cfg.model.max_output_tokens,
            )
            launch = await ctx.harness.prepare(sandbox, context)
            # A sandbox of the task's own image (a container) may lack what the harness needs.
            if (check_runs := sandbox.check_runs) is not None:
                await check_runs(launch.argv[0], f"the {ctx.harness.name} harness")
            return launch

        try:
            # The harness's config goes to HOME while the workspace is laid out: neither reads the other.
            steps = [
                lay_out(sandbox, req.task.workspace, ctx.workspaces, baseline=False),
                install_and_prepare(gw),
            ]
            if harbor.is_harbor(req.task):
                steps.append(harbor.prepare_agent(sandbox))
            review.laid_out_as, launch, *_ = await _gather_or_cancel(*steps)
        except (InstallError, Exception) as exc:
            timer.lap("setup")
            return _finish(row, Outcome.of(FailureKind.SETUP_FAILED, describe(exc)), timer)
        timer.lap("setup")
        # A local grading sandbox starts in milliseconds: beside the harness, not during the setup.
        review.begin_beside_harness()

        expire = asyncio.Event() if wall > deadline else None  # limits.deadline_counts: agent
        # Where the sandbox's exec can be ended early, the harness is stopped once the gateway has closed
        # its session. Elsewhere harnesses end on their own or at the deadline.
        stoppable = isinstance(sandbox, StopsOnEvent)
        try:
            result = await _run_harness(sandbox, launch, deadline, wall, gw, expire, stoppable)
        except SandboxLostError as exc:
            timer.lap("agent")
            return _finish(row, Outcome.of(FailureKind.SANDBOX_LOST, describe(exc)), timer)
        # A request the model has sat on for a quarter of the deadline when the deadline falls makes the
        # end the model's: the gateway's own stall bounds (minutes) can be longer than a short deadline.
        ctx.gateway.close_session(gw, stall_bound_s=deadline * DEADLINE_STALL_SHARE)
        report = await ctx.harness.parse(sandbox, result)
        timer.lap("agent")
        outcome = classify(result, report, gw)
        if expire is not None and result.timed_out and not expire.is_set():
            outcome = _wall_cap_fell(outcome, wall, deadline, gw)
        _record_agent(row, result, report, gw)
        if isinstance(sandbox, EndsCommands) and not harbor.is_harbor(req.task):
            # Nothing of the agent's runs on while it is graded (a Harbor task's logs are carried by a
            # command in its sandbox), and its sandbox's server can serve the grading sandbox.
            await sandbox.end_commands()
        # The evidence copy reads the harness's files while the diff and the verifier use the workspace.
        evidence = asyncio.ensure_future(_keep_evidence(sandbox, result, report, evidence_dir, row))
        try:
            grade = cfg.policy.rule_for(outcome.failure_kind).grade and req.task.verify is not None
            outcome = await review(sandbox, outcome, row, grade=grade, evidence_dir=evidence_dir)
            await evidence
        finally:
            evidence.cancel()  # only when the grading raised, or the session was cancelled
        timer.lap("verify")
        return _finish(row, outcome, timer)
    finally:
        if gw is not None:
            ctx.gateway.close_session(gw)
        if sandbox is not None:
            stopped, reviewed = await asyncio.gather(grading.stop_sandbox(sandbox), review.close())
            row.cleanup_ok = stopped and reviewed
            row.t_cleanup_s = timer.since_lap()
            row.t_total_s = round(sum(timer.marks.values()) + row.t_cleanup_s, 4)
        else:
            await review.close()  # nothing of it began: this ends its session's set-up for the provider


async def _run_harness(
    sandbox: Sandbox,
    launch: Launch,
    deadline: float,
    wall: float,
    gw: GatewaySession,
    expire: asyncio.Event | None,
    stoppable: bool,
) -> ExecResult:
    """The harness to its end. With ``expire`` (agent time), it may run ``wall`` seconds, and ends as
    timed out once its own time, the wall time less the time a model request was outstanding, reaches
    ``deadline``. ``stoppable`` (the sandbox's exec takes an expire event): the harness is stopped
    CLOSED_SESSION_GRACE_S after the gateway closes its session, and its result is then not timed out."""
    if expire is None and not stoppable:
        return await sandbox.exec(
            launch.argv, timeout=deadline, env=launch.env, stdin=launch.stdin, name="harness"
        )
    stop = asyncio.Event()
    closed_first: list[bool] = []
    watches = [asyncio.ensure_future(_stop_when_closed(gw, stop, closed_first))] if stoppable else []
    if expire is not None:
        watches.append(asyncio.ensure_future(_charge_agent_time(gw, deadline, expire)))
        watches.append(asyncio.ensure_future(_relay_event(expire, stop)))
    try:
        result = await sandbox.exec(  # type: ignore[call-arg]  # a StopsOnEvent sandbox (see the caller)
            launch.argv,
            timeout=wall if expire is not None else deadline,
            env=launch.env,
            stdin=launch.stdin,
            name="harness",
            expire=stop,
        )
    finally:
        for watch in watches:
            watch.cancel()
    if closed_first and result.timed_out and result.limit is None:
        # Stopped because the gateway closed the session, not by its deadline (classify: the gateway's
        # cause decides either way; the row's timed_out stays the deadline's).
        return result.model_copy(update={"timed_out": False})
    return result


async def _stop_when_closed(gw: GatewaySession, stop: asyncio.Event, closed_first: list[bool]) -> None:
    """Set ``stop`` once the gateway has closed the session, after a grace in which a harness that got the
    closing answer ends on its own (its exit and its last words kept): one that would wait out its own
    reconnect backoff before its next request (OpenCode: about 17 s a time) holds its sandbox for
    nothing, since every request of a closed session is refused."""
    await gw.wait_closed()
    await asyncio.sleep(CLOSED_SESSION_GRACE_S)
    if not stop.is_set():
        closed_first.append(True)
        stop.set()


async def _relay_event(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


async def _charge_agent_time(gw: GatewaySession, budget_s: float, expire: asyncio.Event) -> None:
    """Set ``expire`` once the agent's own time reaches ``budget_s``. It wakes when the budget would run
    out if no more model time came, so it never wakes late; the harness's exec cancels it at its end."""
    started, waited = time.monotonic(), gw.model_wait_now()
    while (left := budget_s - (time.monotonic() - started) + (gw.model_wait_now() - waited)) > 0:
        await asyncio.sleep(max(left, AGENT_TIME_TICK_S))
    expire.set()


def _wall_cap_fell(outcome: Outcome, wall: float, deadline: float, gw: GatewaySession) -> Outcome:
    """The wall cap, not the agent's own budget, ended the harness: the model's time did."""
    if outcome.failure_kind is not FailureKind.AGENT_TIMEOUT:
        return outcome
    message = (
        f"the wall cap of {wall:.0f}s fell before the agent used its {deadline:.0f}s: "
        f"{gw.model_wait_s:.1f}s went waiting on the model"
    )
    return outcome.model_copy(
        update={"status": Status.FAILED, "failure_kind": FailureKind.MODEL_TIMEOUT, "error_message": message}
    )


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


def _record_agent(row: Row, result: ExecResult, report: HarnessReport, gw: GatewaySession) -> None:
    # The gateway saw what the endpoint really reported; Codex prints 0 for usage it never received.
    row.input_tokens, row.output_tokens = _gateway_usage(gw)
    row.cached_input_tokens = report.usage.cached_input_tokens
    row.reasoning_tokens = report.usage.reasoning_tokens
    row.exit_code, row.timed_out = result.exit_code, result.timed_out
    row.stdout_tail, row.stderr_tail = result.stdout_tail, result.stderr_tail
    row.final_text = report.final_text
    row.messages = [Message.of(m) for m in report.messages]
    row.tool_calls = [ToolCall.of(t) for t in report.tool_calls]
    row.model_calls = [ModelCall.of(a) for a in gw.attempts]
    row.t_model_wait_s = round(gw.model_wait_s, 4)
    row.evidence_gaps.extend(report.evidence_gaps)
    row.evidence_gaps.extend(gw.evidence_gaps())  # bodies past the session's kept-bytes bound
    if row.input_tokens is None and "usage_unavailable" not in row.evidence_gaps:
        row.evidence_gaps.append("usage_unavailable")


def _gateway_usage(gw: GatewaySession) -> tuple[int | None, int | None]:
    """Summed token counts of the answered attempts; unknown if any answered attempt lacked them."""
    answered = [a for a in gw.attempts if a.kind is FailureKind.NONE]
    if not answered:
        return None, None
    ins = [a.input_tokens for a in answered]
    outs = [a.output_tokens for a in answered]
    return (None if None in ins else sum(ins)), (None if None in outs else sum(outs))


async def _keep_evidence(
    sandbox: Sandbox, result: ExecResult, report: HarnessReport, evidence_dir: Path, row: Row
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
            row.evidence_gaps.append(f"{name}_unavailable: {describe(exc)[:200]}")
            continue
        # Compressed in a thread when large: up to EVIDENCE_COPY_LIMIT of it (~0.2 s) would hold up the
        # loop that serves every other session's model requests.
        await small_inline(len(data), _write_compressed, evidence_dir / name, data)


def _write_compressed(path: Path, data: bytes) -> None:
    path.write_bytes(gzip.compress(data, compresslevel=3))


def _finish(row: Row, outcome: Outcome, timer: _Timer) -> Row:
    """The row with its outcome and phase times; a phase never reached keeps a null time."""
    row.t_setup_s = timer.marks.get("setup")
    row.t_agent_s = timer.marks.get("agent")
    row.t_verify_s = timer.marks.get("verify")
    row.status = outcome.status.value
    row.failure_kind = outcome.failure_kind.value
    row.http_status = outcome.http_status
    row.error_message = outcome.error_message
    row.error_detail = json.dumps(outcome.error_detail, default=str)[:16_000]
    row.retry_after_s = outcome.retry_after_s
    return row


def lost_row(
    req: SessionRequest,
    harness: str,
    provider: str,
    message: str,
    known: dict[str, Any] | None = None,
    kind: FailureKind = FailureKind.SANDBOX_LOST,
) -> dict[str, Any]:
    """The row of an attempt that never returned its own: its worker or node died (``sandbox_lost``), or
    the run was stopped (``cancelled``). ``known``: what was known of it as row columns (placement, start
    as epoch seconds, phase times so far; executor/placement.py); its start is else now."""
    outcome = Outcome.of(kind, message)
    known = dict(known or {})
    started = known.pop("started_at", None)
    row = Row(
        run_id=req.run_id,
        rollout_id=req.rollout_id,
        task_id=req.task.id,
        sample_index=req.sample_index,
        attempt=req.attempt,
        policy_version=req.policy_version,
        harness=harness,
        sandbox_provider=provider,
        status=outcome.status.value,
        failure_kind=outcome.failure_kind.value,
        error_message=outcome.error_message,
        evidence_gaps=["worker_lost" if kind is FailureKind.SANDBOX_LOST else "run_stopped"],
        started_at=datetime.fromtimestamp(started, UTC) if started is not None else datetime.now(UTC),
    )
    for name, value in known.items():
        setattr(row, name, value)
    return row.to_dict()
