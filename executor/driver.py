"""The driver loop: bounded admission, results as they complete, the policy's decision, bounded retries."""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
import yaml
from ray.exceptions import (
    ActorUnavailableError,
    RayActorError,
    RayError,
    RayTaskError,
    TaskCancelledError,
)

from executor import capacity, orphans, phases, stopping, warm
from executor.admission import OBSERVED_FIELDS, Admission
from executor.cluster import asks_own_cluster, cluster_address
from executor.config import RunConfig
from executor.local_ray import start_local_ray
from executor.placement import Placements
from executor.progress import Progress
from executor.reaper import reap_quietly
from executor.runs import run_lock
from executor.schema import batch_from_wire, model_call_fields, rows_to_batch, warm_up, with_decisions
from executor.session import SessionRequest, lost_row
from executor.storage import describe_error, locate
from executor.store import ResumeState, RunStore, StoreError, iter_rows_newest_first, read_table
from executor.tasks import Task, load_tasks
from executor.worker import RemoteSandboxWorker
from harnesses.install import default_cache_root
from harnesses.registry import make_harness
from policy import (
    KIND_INFO,
    CircuitBreaker,
    Decision,
    FailureKind,
    GroupAction,
    GroupBook,
    GroupMode,
    Outcome,
    PolicyConfig,
    Status,
    Verdict,
    decide,
    decide_group,
)

log = logging.getLogger(__name__)

WAIT_S = 0.25
CANCEL_GRACE_S = 60.0
# A session sent to a worker we already know died, while Ray restarts it, never ran: send it again,
# same attempt, after a pause; bounded, after which it is a sandbox_lost attempt like any other.
UNAVAILABLE_PAUSE_S = 1.0
UNAVAILABLE_RESENDS = 120
CLOSE_S = 30.0  # for the workers to close what they hold before the cluster they run in stops


@dataclass(order=True)
class _Retry:
    ready_at: float
    seq: int
    task: Task = field(compare=False)
    sample_index: int = field(compare=False)
    attempt: int = field(compare=False)


@dataclass
class RunSummary:
    run_id: str
    run_dir: str
    rows: int
    final: int
    pending: int
    by_decision: dict[str, int]
    by_status: dict[str, int]
    by_failure_kind: dict[str, int]
    stopped: str | None
    exit_code: int
    # "policy" (e.g. provider_auth_error), "breaker", "store", "signal" (SIGTERM, SIGINT: exit 128 + signum)
    stopped_by: str | None = None
    masked: int = 0
    # Training-facing statistics: final accepted rows with a reward only; masked rows never count.
    reward: dict[str, float | int | None] = field(default_factory=dict)
    breaker: dict[str, object] = field(default_factory=dict)
    # When the run's fixed costs fell (executor/phases.py): seconds after the command started.
    phases: dict[str, float] = field(default_factory=dict)


# The GCS address of the local cluster this process started, while it runs: that one is ours to stop.
_own_gcs: str | None = None
# This process's hold on the warm executor it attached to (executor/warm.py), while attached.
_warm_lease: warm.Lease | None = None
# The warm executor was let go of (workers released, lease released) but its connection was left for the
# process's exit to close (``leave_ray(..., exiting=True)``).
_left_connected = False


def connect_ray(cfg: RunConfig) -> bool:
    """Join the cluster ``cfg`` or ``RAY_ADDRESS`` names (see ``cluster_address``), else attach to the
    warm executor ``rollout up`` left running, else start a local one of our own. True when connected to
    a local cluster this process started (then it is ours to stop, by ``stop_own_ray``), False when
    joined or attached (``leave_ray`` lets go of either)."""
    global _own_gcs, _warm_lease
    if ray.is_initialized():
        stopping.take()
        return _own_gcs is not None and ray.get_runtime_context().gcs_address == _own_gcs
    try:
        return _connect(cfg)
    finally:
        stopping.take()  # after ray.init, which sets its own handlers (executor/stopping.py)


def _connect(cfg: RunConfig) -> bool:
    global _own_gcs, _warm_lease
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cluster_address(cfg.ray_address)
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    if not asks_own_cluster(cfg.ray_address) and (lease := warm.attach()) is not None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as the warm executor's cluster was started
        try:
            warm.connect(lease.record)
        except Exception:
            lease.release()
            raise
        _warm_lease = lease
        return False
    _own_gcs = start_local_ray()
    return True


def attached_lease() -> warm.Lease | None:
    """The warm executor this process is attached to, if it is."""
    return _warm_lease


def leave_ray(own: bool, workers: list[Any], *, exiting: bool = False) -> None:
    """Once the run's work is safe: stop the cluster we started, or let go of the warm executor (its
    workers keep what they built, the next run gets them warm). A joined cluster is left as it is.

    ``exiting``: the process ends next (``rollout run``). An attached driver then leaves its connection
    for that end to close (``left_connected``): ``ray.shutdown()`` of a driver spends ~0.3 s waiting on
    its core worker's disconnect, while a driver's process ending tells the cluster the same (its job
    ends). Nothing of the run waits on the connection by then: every row and the summary are written,
    the workers have released the run's parts and hold no session of it, and the lease is given back."""
    global _warm_lease, _left_connected
    if own:
        stop_own_ray(workers)
    elif _warm_lease is not None:
        warm.release(workers)
        if exiting:
            _left_connected = True
        else:
            ray.shutdown()  # our driver's connection only: the warm cluster runs on
        _warm_lease.release()
        _warm_lease = None


def left_connected() -> bool:
    """True once this process let go of the warm executor it attached to and left its connection to it
    for the process's end to close (``leave_ray(..., exiting=True)``): the process must end next."""
    return _left_connected


def stop_own_ray(workers: list[Any]) -> None:
    """Stop the local cluster this process started, once the run's work is safe (rows durable,
    sandboxes stopped, summary written): the workers close what they hold, then the cluster goes.

    ``ray.shutdown()`` at interpreter exit took ~2 s, none of it ours: a 0.5 s pause for log lines
    (only when called from atexit), then each of Ray's processes in turn is sent SIGTERM and given up
    to 1 s (the autoscaler monitor took all of that second; it is not started now, see
    ``_lean_node``)."""
    global _own_gcs
    # A worker class without close (a benchmark's null worker) holds nothing to close.
    closes = [close.remote() for w in workers if (close := getattr(w, "close", None)) is not None]
    try:
        ray.get(closes, timeout=CLOSE_S)
    except (RayError, TimeoutError) as exc:
        # A worker gone or stuck: its sandboxes' supervisors end with its process, as after a crash.
        log.warning("workers did not all close within %.0f s: %s", CLOSE_S, str(exc)[:500])
    ray.shutdown()
    _own_gcs = None


def worker_options(cfg: RunConfig) -> dict[str, Any]:
    """How the run's worker actors are placed and restarted."""
    return {
        "num_cpus": 0,
        "max_restarts": -1,
        "max_task_retries": 0,
        "max_concurrency": cfg.concurrency.sessions_per_worker + 8,
        "resources": cfg.concurrency.worker_resources or None,
        "scheduling_strategy": "SPREAD",
    }


def decide_row(
    row: dict[str, Any], attempt: int, policy: PolicyConfig, *, budget_left: int, rng: random.Random
) -> tuple[Verdict, dict[str, list[Any]]]:
    """The policy's verdict on one session's row, and the decision columns the driver writes for it."""
    outcome = Outcome(
        status=Status(row["status"]),
        failure_kind=FailureKind(row["failure_kind"]),
        retry_after_s=row.get("retry_after_s"),
    )
    verdict = decide(outcome, attempt, policy, budget_left=budget_left, rng=rng)
    return verdict, decision_columns(verdict)


def decision_columns(verdict: Verdict) -> dict[str, list[Any]]:
    """The decision columns of one row from its verdict."""
    final = verdict.decision is not Decision.RETRY
    masked = verdict.decision is Decision.MASK
    decisions: dict[str, list[Any]] = {
        "decision": [verdict.decision.value],
        "decision_reason": [verdict.reason[:1000]],
        "masked": [masked],
        "final": [final],
        "retry_delay_s": [verdict.retry_delay_s if not final else None],
    }
    if masked:
        decisions["reward"] = [None]  # a masked row is never a reward, not even a verified one
    return decisions


def training_reward_stats(
    decisions: list[str | None], rewards: list[float | None], finals: list[bool | None]
) -> dict[str, float | int | None]:
    """Reward statistics over final accepted rows only: a masked row is never a training signal."""
    values = [
        r
        for d, r, f in zip(decisions, rewards, finals, strict=True)
        if f and d == Decision.ACCEPT.value and r is not None
    ]
    mean = sum(values) / len(values) if values else None
    return {
        "count": len(values),
        "mean": mean,
        "min": min(values, default=None),
        "max": max(values, default=None),
    }


# What the driver reads of a row to decide on it; the rest travels on to the store unconverted.
_VERDICT_COLUMNS = ("status", "failure_kind", "retry_after_s", "error_message")


class Driver:
    def __init__(
        self, cfg: RunConfig, worker_class: Any = RemoteSandboxWorker, *, exiting: bool = False
    ) -> None:
        """``worker_class``: the Ray actor class hosting sessions (benchmarks swap in a null one).
        ``exiting``: the process ends once ``run`` returns (``rollout run``; see ``leave_ray``)."""
        assert cfg.run_id
        self.cfg = cfg
        self.worker_class = worker_class
        self.exiting = exiting
        self.run_dir = locate(cfg.out) / cfg.run_id
        self.store = RunStore(self.run_dir)
        self.rng = random.Random()
        self._seq = itertools.count()
        self._retries: list[_Retry] = []
        self._inflight: dict[ray.ObjectRef, tuple[SessionRequest, int]] = {}
        self._load: list[int] = []
        self._stopped: str | None = None
        self._stopped_by: str | None = None
        self._own_ray = False  # a local cluster this driver started: stopped when the run ends
        self._binding: tuple[tuple[str, str], ...] = ()  # the run, sent with each session to warm workers
        self._workers: list[Any] = []
        self._submitted_at: dict[ray.ObjectRef, float] = {}
        self._worker_died_at: dict[int, float] = {}
        self._resends: dict[tuple[str, int], int] = {}
        self._signal: int | None = None  # the signal that stopped the run
        self._cancelled: list[ray.ObjectRef] = []  # sessions cancelled at a stop, their rows written
        self.placements = Placements()
        self.breaker = CircuitBreaker(cfg.policy.breaker)
        self.admission = Admission(cfg.in_flight_cap, cfg.concurrency.admission)
        # (request, batch, verdict) of final rows waiting for the rest of their group; see policy/groups.py
        self.groups: GroupBook[tuple[SessionRequest, pa.RecordBatch, Verdict]] = GroupBook()

    def run(self) -> RunSummary:
        """Run (or resume) the run; RunLockedError, with nothing written, if another driver holds it."""
        with run_lock(self.run_dir):
            try:
                return self._run_locked()
            finally:
                # Under the lock still: the next driver of this run starts once our sandboxes are gone.
                self._await_cancelled()
                if self._worker_died_at:  # what dead workers left, on whichever node they ran
                    reap_quietly(self.cfg.sandbox, everywhere=True)
                leave_ray(self._own_ray, self._workers, exiting=self.exiting)
                stopping.release()

    def _run_locked(self) -> RunSummary:
        cfg = self.cfg
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-plan") as pool:
            # The run's own work before its first session (resume scan, config and task snapshot, task
            # count, harness check) is disk and subprocess waits: it goes on beside Ray's start and the
            # worker actors' (each a fresh process importing our modules), not before them.
            planned = pool.submit(self._plan)
            self._own_ray = connect_ray(cfg)
            phases.mark("ray_up")
            capacity.check(cfg.concurrency.worker_resources, cfg.concurrency.workers)
            self._workers = workers = self._start_workers()
            phases.mark("workers_created")
            plan = planned.result()
        if plan is None:
            # The run this resumes stopped at a bound that still holds: more sessions would only burn more.
            self._stop(self.breaker.tripped or "", "breaker")
            return self._summarize()
        state, total = plan
        budget = max(cfg.policy.retry_budget - state.retries_used, 0)
        source = self._requests(state)
        progress = Progress(cfg.run_id or "", total)
        watch = capacity.Watch(cfg.concurrency.worker_resources, len(workers))
        self._load = [0] * len(workers)
        exhausted = False
        try:
            while True:
                if (signum := stopping.requested()) is not None and not self._stopped:
                    self._signal = signum
                    self._stop(f"stopped by {signal.Signals(signum).name}", "signal")
                if self._stopped:
                    break  # what is in flight is cancelled and written below
                while len(self._inflight) < self.admission.cap and not self._stopped:
                    now = time.monotonic()
                    if self._retries and self._retries[0].ready_at <= now:
                        r = heapq.heappop(self._retries)
                        self._submit(
                            workers, SessionRequest(cfg.run_id or "", r.task, r.sample_index, r.attempt)
                        )
                        continue
                    if exhausted:
                        break
                    nxt = next(source, None)
                    if nxt is None:
                        exhausted = True
                        continue
                    self._submit(workers, nxt)
                progress.in_flight = len(self._inflight)
                progress.waiting_retry = len(self._retries)
                if not self._inflight:
                    if self._stopped or (exhausted and not self._retries):
                        break
                    # Waiting for a retry's backoff or for the endpoint's Retry-After hold to pass.
                    wait = self._retries[0].ready_at - time.monotonic() if self._retries else WAIT_S
                    time.sleep(min(max(wait, 0.0), WAIT_S))
                    continue
                ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=WAIT_S)
                if ready:
                    more, _ = ray.wait(list(self._inflight), num_returns=len(self._inflight), timeout=0)
                    ready = list(dict.fromkeys(ready + more))
                for ref in ready:
                    budget = self._settle(ref, budget, progress)
                self.placements.poll(workers, self._load)
                self.store.maybe_flush()
                watch.tick()
                progress.cluster = watch.note
                progress.tick()
        except KeyboardInterrupt:
            self._stop("interrupted", "interrupted")
        except StoreError as exc:
            self._stop(f"output: {exc}", "store")
        finally:
            self._cancel_in_flight(budget, progress)
            try:
                self.store.flush()
            except StoreError as exc:
                # These rows were never written, so their samples run again on resume; none is half-kept.
                log.error("buffered rows not written: %s", exc)
                self._stop(f"output: {exc}", "store")
            progress.close()
        phases.mark("last_row")
        self._note_worker_ready(workers)
        return self._summarize()

    def _plan(self) -> tuple[ResumeState, int] | None:
        """What is left to run and how much of it, with the config written; None when the run this
        resumes stopped at a bound that still holds. Writes nothing before that check."""
        cfg = self.cfg
        state = self.store.resume_state()
        if state.rows and self._restore_breaker():
            return None
        self._write_config()
        # What a driver killed outright left (before its first row, too): launches no row names.
        orphans.adopt(self.run_dir, state, cfg, self._append_cancelled)
        total = self._count_pending(state)
        # Install once here so the first sessions don't all queue on the install lock.
        make_harness(cfg.harness.name, cfg.harness.version, cfg.harness.command).ensure_installed(
            default_cache_root()
        )
        warm_up()  # pyarrow's one-time costs, here rather than at the first row
        return state, total

    def _start_workers(self) -> list[Any]:
        """The worker actors, created at once: each starts its process while the driver goes on."""
        cfg = self.cfg
        options = worker_options(cfg)
        if attached_lease() is not None:
            # Every session names its run: a warm worker serves run after run (see SandboxWorker.run).
            self._binding = ((cfg.model_dump_json(), str(self.run_dir)),)
            return warm.workers(cfg, str(self.run_dir), self.worker_class, options)
        return [
            self.worker_class.options(**options).remote(cfg.model_dump_json(), str(self.run_dir), i)
            for i in range(cfg.concurrency.workers)
        ]

    def _note_worker_ready(self, workers: list[Any]) -> None:
        """Mark when the first worker actor was up, from its own clock: on this host's monotonic clock
        only when the cluster is ours (a joined cluster's workers may be on other hosts)."""
        if not workers or self._stopped or not self._own_ray:
            return  # a stopped run may have a worker dead or restarting: its exit must not wait on it
        try:
            infos = ray.get([w.info.remote() for w in workers], timeout=2.0)
        except (RayError, TimeoutError, AttributeError):
            return  # a null worker class, or a worker gone: the mark is only for the benchmark
        ready = [i["ready_monotonic"] for i in infos if isinstance(i, dict) and "ready_monotonic" in i]
        if ready:
            phases.mark("first_worker_ready", min(ready))

    def _restore_breaker(self) -> str | None:
        """Feed the breaker the rows already written, newest first, reading back only as far as it needs."""
        rows = iter_rows_newest_first(self.store.rows_dir, ["failure_kind", "decision", "final"])
        return self.breaker.restore(
            (KIND_INFO[FailureKind(kind)].infrastructure, kind, final, decision == Decision.MASK.value)
            for kind, decision, final in rows
        )

    def _requests(self, state: ResumeState) -> Iterator[SessionRequest]:
        for task in load_tasks(Path(self.cfg.tasks)):
            if self.cfg.policy.group is not GroupMode.NONE:
                pending = sum((task.id, s) not in state.final for s in range(self.cfg.samples))
                if pending:
                    self.groups.expect(task.id, pending)
            for sample in range(self.cfg.samples):
                key = (task.id, sample)
                if key not in state.final:
                    yield SessionRequest(
                        self.cfg.run_id or "", task, sample, state.last_attempt.get(key, 0) + 1
                    )

    def _count_pending(self, state: ResumeState) -> int:
        count = 0
        for task in load_tasks(Path(self.cfg.tasks)):
            count += sum((task.id, s) not in state.final for s in range(self.cfg.samples))
        return count

    def _submit(self, workers: list[Any], req: SessionRequest) -> None:
        index = min(range(len(workers)), key=self._load.__getitem__)
        ref = workers[index].run.remote(
            req.task.model_dump_json(), req.sample_index, req.attempt, *self._binding
        )
        self._inflight[ref] = (req, index)
        self.placements.dispatched(ref, req.rollout_id, index)
        self._submitted_at[ref] = time.monotonic()
        self._load[index] += 1

    def _settle(self, ref: ray.ObjectRef, budget: int, progress: Progress) -> int:
        req, index = self._inflight.pop(ref)
        phases.mark("first_row")
        self._load[index] -= 1
        submitted_at = self._submitted_at.pop(ref, 0.0)
        known = self.placements.known(ref)
        try:
            batch = batch_from_wire(ray.get(ref))
        except ActorUnavailableError as exc:
            key = (req.task.id, req.sample_index)
            died_at = self._worker_died_at.get(index)
            known_dead = died_at is not None and submitted_at >= died_at
            if known_dead and self._resends.get(key, 0) < UNAVAILABLE_RESENDS:
                self._resends[key] = self._resends.get(key, 0) + 1
                heapq.heappush(
                    self._retries,
                    _Retry(
                        time.monotonic() + UNAVAILABLE_PAUSE_S,
                        next(self._seq),
                        req.task,
                        req.sample_index,
                        req.attempt,
                    ),
                )
                return budget
            self._note_death(index, submitted_at)
            batch = self._lost(req, f"worker actor died mid-session: {str(exc)[:500]}", known)
        except TaskCancelledError as exc:
            if self._stopped:
                self._write_cancelled(req, known, progress)
                return budget
            batch = self._lost(req, f"session cancelled: {str(exc)[:500]}", known)
        except RayActorError as exc:
            self._note_death(index, submitted_at)
            batch = self._lost(req, f"worker actor died mid-session: {str(exc)[:500]}", known)
            # Its sandboxes (jobs, tasks, process trees, directories) must not outlive it, on its node.
            reap_quietly(self.cfg.sandbox, everywhere=True)
        except RayTaskError as exc:
            batch = self._lost(req, f"worker raised: {str(exc)[-2000:]}", known)
        except RayError as exc:
            batch = self._lost(req, f"ray error: {str(exc)[:1000]}", known)
        row = batch.select(_VERDICT_COLUMNS).to_pylist()[0]
        self.admission.observe(model_call_fields(batch, OBSERVED_FIELDS))
        kind = FailureKind(row["failure_kind"])
        verdict, _ = decide_row(row, req.attempt, self.cfg.policy, budget_left=budget, rng=self.rng)
        if self.breaker.record_attempt(KIND_INFO[kind].infrastructure, kind.value):
            self._stop(self.breaker.tripped or "", "breaker")
        if verdict.decision is Decision.RETRY:
            budget -= 1
            self._schedule(req, verdict.retry_delay_s)
        if verdict.decision is not Decision.RETRY and self.cfg.policy.group is not GroupMode.NONE:
            group = self.groups.hold(
                req.task.id, req.sample_index, (req, batch, verdict), verdict.decision is Decision.MASK
            )
            if group is not None:
                budget = self._write_group(req.task.id, [held for _, held, _ in group], budget, progress)
        else:
            self.store.append(self._decided(batch, verdict, progress))
        if self.cfg.policy.rule_for(kind).stop_run:
            self._stop(f"{kind.value}: {row['error_message'] or ''}"[:500], "policy")
        return budget

    def _decided(self, batch: pa.RecordBatch, verdict: Verdict, progress: Progress) -> pa.RecordBatch:
        """The row with its decision columns, counted in progress and in the breaker."""
        final = verdict.decision is not Decision.RETRY
        masked = verdict.decision is Decision.MASK
        names = ("failure_kind", "status", "harness", "sandbox_provider")
        first = {n: batch.column(n)[0].as_py() for n in names}
        progress.record(
            verdict.decision.value,
            first["failure_kind"],
            final,
            status=first["status"],
            harness=first["harness"],
            provider=first["sandbox_provider"],
        )
        if final and self.breaker.record_final(masked):
            self._stop(self.breaker.tripped or "", "breaker")
        return with_decisions(batch, decision_columns(verdict))

    def _write_group(
        self,
        task_id: str,
        held: list[tuple[SessionRequest, pa.RecordBatch, Verdict]],
        budget: int,
        progress: Progress,
    ) -> int:
        """Write a whole group at once, each row carrying the group's decision, in one part file."""
        policy = self.cfg.policy
        group = decide_group(
            policy.group,
            [v.decision is Decision.MASK for _, _, v in held],
            resubmits_done=self.groups.resubmits(task_id),
            max_resubmits=policy.group_resubmits,
            budget_left=budget,
        )
        batches = []
        for req, batch, verdict in held:
            own = verdict
            if group.action is GroupAction.MASK and verdict.decision is not Decision.MASK:
                own = Verdict(Decision.MASK, group.reason)
            elif group.action is GroupAction.RESUBMIT:
                own = Verdict(Decision.RETRY, group.reason, 0.0)
                budget -= 1
                self._schedule(req, 0.0)
            batches.append(self._decided(batch, own, progress))
        if group.action is GroupAction.RESUBMIT:
            self.groups.resubmitted(task_id)
        else:
            self.groups.close(task_id)
        self.store.append(pa.concat_batches(batches))  # one append: a group never spans two part files
        return budget

    def _schedule(self, req: SessionRequest, delay_s: float) -> None:
        heapq.heappush(
            self._retries,
            _Retry(time.monotonic() + delay_s, next(self._seq), req.task, req.sample_index, req.attempt + 1),
        )

    def _stop(self, reason: str, by: str) -> None:
        if self._stopped:
            return
        self._stopped, self._stopped_by = reason, by
        # info, not error: the CLI prints the reason once, as the run's one message about it.
        # The loop ends at its next turn; the sessions in flight are cancelled then (``_cancel_in_flight``),
        # once their workers have said what they did so far.
        log.info("stopping the run: %s", reason)

    def _note_death(self, index: int, submitted_at: float) -> None:
        """Record a worker's death once per burst: sessions sent before it died do not move the mark."""
        died_at = self._worker_died_at.get(index)
        if died_at is None or submitted_at > died_at:
            self._worker_died_at[index] = time.monotonic()

    def _lost(self, req: SessionRequest, message: str, known: dict[str, Any]) -> pa.RecordBatch:
        cfg = self.cfg
        return rows_to_batch([lost_row(req, cfg.harness.name, cfg.sandbox.provider, message, known)])

    def _cancel_in_flight(self, budget: int, progress: Progress) -> None:
        """At a stop: the sessions that ended meanwhile are settled as usual; the rest are cancelled (their
        sandboxes stop as they end, ``_await_cancelled``) and written at once as ``cancelled`` rows, which
        a resume runs again, so that a stop with a short grace (``ray job stop`` kills after 3 s) keeps
        what it knew of them."""
        if not self._inflight:
            return
        self.placements.refresh(self._workers, [i for i, n in enumerate(self._load) if n])
        ready, _ = ray.wait(list(self._inflight), num_returns=len(self._inflight), timeout=0)
        for ref in ready:
            try:
                budget = self._settle(ref, budget, progress)
            except StoreError as exc:
                self._stop(f"output: {exc}", "store")
        for ref, (req, _index) in list(self._inflight.items()):
            ray.cancel(ref)
            self._write_cancelled(req, self.placements.known(ref), progress)
            self._cancelled.append(ref)
        self._inflight.clear()

    def _write_cancelled(self, req: SessionRequest, known: dict[str, Any], progress: Progress) -> None:
        """The row of a session the run's stop cancelled: retried on resume, outside the policy, the retry
        budget and the breaker (the stop was nobody's failure)."""
        cfg = self.cfg
        message = f"the run was stopped: {self._stopped or 'cancelled'}"[:500]
        row = lost_row(req, cfg.harness.name, cfg.sandbox.provider, message, known, FailureKind.CANCELLED)
        progress.record(
            Decision.RETRY.value,
            FailureKind.CANCELLED.value,
            False,
            harness=cfg.harness.name,
            provider=cfg.sandbox.provider,
        )
        try:
            self._append_cancelled([row], flush=False)
        except StoreError as exc:
            self._stop(f"output: {exc}", "store")

    def _append_cancelled(self, rows: list[dict[str, Any]], *, flush: bool = True) -> None:
        """Append ``cancelled`` rows (a stop's, or those a killed driver's launches get on resume),
        each retried on resume, decided here outside the policy: a stop is nobody's failure."""
        if not rows:
            return
        verdict = Verdict(Decision.RETRY, "the run was stopped; resubmitted on resume")
        columns = {name: values * len(rows) for name, values in decision_columns(verdict).items()}
        self.store.append(with_decisions(rows_to_batch(rows), columns))
        if flush:
            self.store.flush()

    def _await_cancelled(self) -> None:
        """Wait, bounded, for the cancelled sessions to stop their sandboxes, before the workers (and
        the cluster we started) go."""
        if self._cancelled:
            ray.wait(self._cancelled, num_returns=len(self._cancelled), timeout=CANCEL_GRACE_S)
            self._cancelled.clear()

    def _write_config(self) -> None:
        self.run_dir.mkdir()
        config = yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False)
        (self.run_dir / "config.yaml").write_text(config)
        # A copy of the tasks beside the config, so `rollout replay` finds a row's task after the file moved.
        snapshot = self.run_dir / ("tasks.parquet" if self.cfg.tasks.endswith(".parquet") else "tasks.jsonl")
        if Path(self.cfg.tasks).is_dir():  # Harbor task directories: the tasks as they were read
            tasks = load_tasks(Path(self.cfg.tasks))
            snapshot.write_text("".join(t.model_dump_json(exclude_none=True) + "\n" for t in tasks))
        else:
            snapshot.put_file(Path(self.cfg.tasks))

    def _summarize(self) -> RunSummary:
        table = read_table(
            self.run_dir,
            ["status", "failure_kind", "decision", "final", "task_id", "sample_index", "reward"],
        )
        cols = table.to_pydict()
        final_keys = {
            (t, s) for t, s, f in zip(cols["task_id"], cols["sample_index"], cols["final"], strict=True) if f
        }
        expected = self._count_expected()
        pending = expected - len(final_keys)
        finals = [i for i, f in enumerate(cols["final"]) if f]

        def count(name: str) -> dict[str, int]:
            out: dict[str, int] = {}
            for i in finals:
                out[cols[name][i]] = out.get(cols[name][i], 0) + 1
            return out

        stopped = self._stopped
        kinds = count("failure_kind")
        if finals and set(kinds) == {FailureKind.SANDBOX_START_FAILED.value} and stopped is None:
            # Nothing ran at all: a configuration the engine cannot start (see the rows' one line).
            stopped = "no sandbox ever started: every final row is sandbox_start_failed"
        exit_code = 0 if not stopped and pending == 0 else 1
        if self._signal is not None:
            exit_code = stopping.exit_code(self._signal)
        summary = RunSummary(
            run_id=self.cfg.run_id or "",
            run_dir=str(self.run_dir),
            rows=table.num_rows,
            final=len(final_keys),
            pending=pending,
            by_decision=count("decision"),
            by_status=count("status"),
            by_failure_kind=kinds,
            stopped=stopped,
            exit_code=exit_code,
            stopped_by=self._stopped_by,
            masked=sum(cols["decision"][i] == Decision.MASK.value for i in finals),
            reward=training_reward_stats(cols["decision"], cols["reward"], cols["final"]),
            breaker=self.breaker.report(),
        )
        phases.mark("summary")
        summary.phases = phases.report()
        try:
            (self.run_dir / "summary.json").write_text(json.dumps(summary.__dict__, indent=2))
        except OSError as exc:  # a full disk must not hide the summary the caller prints
            log.error("summary.json not written: %s", exc.strerror or describe_error(exc))
        return summary

    def _count_expected(self) -> int:
        return sum(self.cfg.samples for _ in load_tasks(Path(self.cfg.tasks)))
