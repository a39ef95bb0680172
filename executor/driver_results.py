"""What the driver does with a session's end: the row from the worker's answer (or the row of a session
lost with its worker), the policy's verdict and staleness, a group held until it is whole, the rows
written and handed to a trainer, retries queued; and at a stop, the sessions in flight cancelled and
written as ``cancelled`` rows. ``Driver`` (executor/driver.py) runs the loop these serve; the state they
share is named here."""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray
from ray.exceptions import (
    ActorUnavailableError,
    RayActorError,
    RayError,
    RayTaskError,
    TaskCancelledError,
)

from executor import phases
from executor.admission import OBSERVED_FIELDS, Admission
from executor.config import RunConfig
from executor.decisions import VERDICT_COLUMNS, decide_row, decision_columns
from executor.driver_types import Retry
from executor.export import as_export
from executor.placement import Placements
from executor.progress import Progress
from executor.reaper import reap_quietly
from executor.schema import batch_from_wire, model_call_fields, rows_to_batch, with_decisions
from executor.session import SessionRequest, lost_row
from executor.store import ResumeState, RunStore, StoreError
from policy import (
    KIND_INFO,
    CircuitBreaker,
    Decision,
    FailureKind,
    GroupAction,
    GroupBook,
    GroupMode,
    GroupVerdict,
    StaleAction,
    Verdict,
    decide_group,
    stale_reason,
    staleness,
    too_stale,
)

log = logging.getLogger("executor.driver")

CANCEL_GRACE_S = 60.0
# A session sent to a worker we already know died, while Ray restarts it, never ran: send it again,
# same attempt, after a pause; bounded, after which it is a sandbox_lost attempt like any other.
UNAVAILABLE_PAUSE_S = 1.0
UNAVAILABLE_RESENDS = 120


class Results:
    """The driver's handling of results; ``Driver`` sets every attribute below in its ``__init__``."""

    cfg: RunConfig
    store: RunStore
    state: ResumeState
    rng: random.Random
    budget: int
    breaker: CircuitBreaker
    admission: Admission
    placements: Placements
    groups: GroupBook[tuple[SessionRequest, pa.RecordBatch, Verdict]]
    versions: dict[str, int]
    sink: Callable[[pa.RecordBatch], None] | None
    undelivered: int
    policy_version: int | None
    _export_form: bool
    _task_info: dict[str, tuple[str, str]]
    _models: dict[int | None, str]
    _seq: itertools.count[int]
    _retries: list[Retry]
    _inflight: dict[ray.ObjectRef, tuple[SessionRequest, int]]
    _load: list[int]
    _workers: list[Any]
    _stopped: str | None
    _stopped_by: str | None
    _submitted_at: dict[ray.ObjectRef, float]
    _worker_died_at: dict[int, float]
    _resends: dict[tuple[str, int], int]
    _cancelled: list[ray.ObjectRef]
    _group_mode: dict[str, GroupMode]
    _open_tasks: dict[str, int]
    _superseded: set[ray.ObjectRef]
    _reruns: dict[tuple[str, int], int]

    def _resend(self, req: SessionRequest, pause_s: float) -> None:
        """Send the same attempt again (it never ran to an end: no row was written for it)."""
        heapq.heappush(
            self._retries,
            Retry(time.monotonic() + pause_s, next(self._seq), req.task, req.sample_index, req.attempt),
        )

    def _settle(self, ref: ray.ObjectRef, progress: Progress) -> None:
        req, index = self._inflight.pop(ref)
        phases.mark("first_row")
        self._load[index] -= 1
        submitted_at = self._submitted_at.pop(ref, 0.0)
        superseded = ref in self._superseded
        self._superseded.discard(ref)
        known = self.placements.known(ref)
        try:
            batch = batch_from_wire(ray.get(ref))
        except ActorUnavailableError as exc:
            key = (req.task.id, req.sample_index)
            died_at = self._worker_died_at.get(index)
            known_dead = died_at is not None and submitted_at >= died_at
            if known_dead and self._resends.get(key, 0) < UNAVAILABLE_RESENDS:
                self._resends[key] = self._resends.get(key, 0) + 1
                self._resend(req, UNAVAILABLE_PAUSE_S)
                return
            self._note_death(index, submitted_at)
            batch = self._lost(req, f"worker actor died mid-session: {str(exc)[:500]}", known)
        except TaskCancelledError as exc:
            if self._stopped:
                self._write_cancelled(req, known, progress)
                return
            if superseded:  # cancelled for staleness: it starts again under the current version
                self.versions["cancelled_superseded"] += 1
                self._resend(req, 0.0)
                return
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
        row = batch.select(VERDICT_COLUMNS).to_pylist()[0]
        self.admission.observe(model_call_fields(batch, OBSERVED_FIELDS))
        kind = FailureKind(row["failure_kind"])
        verdict, _ = decide_row(row, req.attempt, self.cfg.policy, budget_left=self.budget, rng=self.rng)
        if self.breaker.record_attempt(KIND_INFO[kind].infrastructure, kind.value):
            self._stop(self.breaker.tripped or "", "breaker")
        group = self._group_mode.get(req.task.id, GroupMode.NONE)
        if group is GroupMode.NONE:
            verdict = self._unless_stale(req, verdict)
        if verdict.decision is Decision.RETRY:
            self.budget -= 1
            self._schedule(req, verdict.retry_delay_s)
        if verdict.decision is not Decision.RETRY and group is not GroupMode.NONE:
            held = self.groups.hold(
                req.task.id, req.sample_index, (req, batch, verdict), verdict.decision is Decision.MASK
            )
            if held is not None:
                self._write_group(req.task.id, group, [h for _, h, _ in held], progress)
        else:
            self._write([(req, self._decided(batch, verdict, req, progress))], final=verdict.decision)
        if self.cfg.policy.rule_for(kind).stop_run:
            self._stop(f"{kind.value}: {row['error_message'] or ''}"[:500], "policy")

    def _unless_stale(self, req: SessionRequest, verdict: Verdict) -> Verdict:
        """A final verdict on a row that started too many versions ago, as ``policy.staleness`` says."""
        rule, current = self.cfg.policy.staleness, self.policy_version or 0
        if verdict.decision is Decision.RETRY or not too_stale(rule, req.policy_version, current):
            return verdict
        reason = stale_reason(req.policy_version, current, rule)
        if rule.action is StaleAction.DELIVER:
            self.versions["stale_delivered"] += 1
            return verdict
        key = (req.task.id, req.sample_index)
        rerun = rule.action is StaleAction.RERUN and self.budget > 0
        if rerun and self._reruns.get(key, 0) < rule.max_reruns:
            self._reruns[key] = self._reruns.get(key, 0) + 1
            self.versions["stale_rerun"] += 1
            return Verdict(Decision.RETRY, reason, 0.0)
        self._reruns.pop(key, None)
        if verdict.decision is Decision.MASK:
            return verdict  # masked for its own reason, which explains it better
        self.versions["stale_masked"] += 1
        return Verdict(Decision.MASK, reason if rule.action is StaleAction.MASK else f"{reason}; reruns used")

    def _decided(
        self, batch: pa.RecordBatch, verdict: Verdict, req: SessionRequest, progress: Progress
    ) -> pa.RecordBatch:
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
        columns = decision_columns(verdict)
        if req.policy_version is not None:
            columns["staleness"] = [staleness(req.policy_version, self.policy_version or 0)]
        return with_decisions(batch, columns)

    def _write(self, rows: list[tuple[SessionRequest, pa.RecordBatch]], final: Decision) -> None:
        """Append decided rows in one append (so in one part file); a final sample is done."""
        if final is not Decision.RETRY:
            self.undelivered += len(rows) if self.sink is not None else 0
            for req, _ in rows:
                key = (req.task.id, req.sample_index)
                self.state.final.add(key)
                self._reruns.pop(key, None)
                left = self._open_tasks.get(req.task.id, 1) - 1
                if left > 0:
                    self._open_tasks[req.task.id] = left
                else:
                    self._open_tasks.pop(req.task.id, None)
        batches = [b for _, b in rows]
        self.store.append(batches[0] if len(batches) == 1 else pa.concat_batches(batches))

    def _write_group(
        self,
        task_id: str,
        mode: GroupMode,
        held: list[tuple[SessionRequest, pa.RecordBatch, Verdict]],
        progress: Progress,
    ) -> None:
        """Write a whole group at once, each row carrying the group's decision, in one part file."""
        policy, rule = self.cfg.policy, self.cfg.policy.staleness
        current = self.policy_version or 0
        stale = [too_stale(rule, req.policy_version, current) for req, _, _ in held]
        group = GroupVerdict(GroupAction.KEEP)
        if any(stale) and rule.action is StaleAction.DELIVER:
            self.versions["stale_delivered"] += sum(stale)
        elif any(stale):
            first = next(req for (req, _, _), s in zip(held, stale, strict=True) if s)
            reason = f"group: {stale_reason(first.policy_version, current, rule)}"
            key = (task_id, -1)
            if rule.action is StaleAction.RERUN and self._reruns.get(key, 0) < rule.max_reruns:
                if self.budget >= len(held):
                    self._reruns[key] = self._reruns.get(key, 0) + 1
                    self.versions["stale_rerun"] += len(held)
                    group = GroupVerdict(GroupAction.RESUBMIT, reason)
            if group.action is GroupAction.KEEP:
                self.versions["stale_masked"] += len(held)
                group = GroupVerdict(GroupAction.MASK, reason)
        if group.action is GroupAction.KEEP:
            group = decide_group(
                mode,
                [v.decision is Decision.MASK for _, _, v in held],
                resubmits_done=self.groups.resubmits(task_id),
                max_resubmits=policy.group_resubmits,
                budget_left=self.budget,
            )
        rows = []
        for req, batch, verdict in held:
            own = verdict
            if group.action is GroupAction.MASK and verdict.decision is not Decision.MASK:
                own = Verdict(Decision.MASK, group.reason)
            elif group.action is GroupAction.RESUBMIT:
                own = Verdict(Decision.RETRY, group.reason, 0.0)
                self.budget -= 1
                self._schedule(req, 0.0)
            rows.append((req, self._decided(batch, own, req, progress)))
        if group.action is GroupAction.RESUBMIT:
            self.groups.resubmitted(task_id)
        else:
            self.groups.close(task_id)
            self._group_mode.pop(task_id, None)
            self._reruns.pop((task_id, -1), None)
        # One append: a group never spans two part files, so a trainer always receives it whole.
        self._write(rows, Decision.RETRY if group.action is GroupAction.RESUBMIT else Decision.ACCEPT)

    def _delivered(self, written: pa.Table) -> None:
        """A part file is written: its final rows go to the trainer, if one reads them."""
        if self.sink is None:
            return
        self.undelivered = 0  # a flush writes every row buffered
        # One copy at most (token ids make rows large): each appended batch, a group whole, is kept as
        # it is when every row of it is final, filtered otherwise, then the part's batches joined once.
        finals = []
        for appended in written.to_batches():
            final = pc.fill_null(appended.column("final"), False)
            finals.append(appended if pc.all(final).as_py() else appended.filter(final))
        finals = [b for b in finals if b.num_rows]
        if not finals:
            return
        batch = finals[0] if len(finals) == 1 else pa.concat_batches(finals)
        if self._export_form:
            versions = batch.column("policy_version").to_pylist()
            names = [self._models.get(v, self.cfg.model.name) for v in versions]
            batch = as_export(batch, True, self._task_info, names)
            for task_id in set(batch.column("task_id").to_pylist()):
                if task_id not in self._open_tasks:
                    self._task_info.pop(task_id, None)
        self.sink(batch)

    def _schedule(self, req: SessionRequest, delay_s: float) -> None:
        heapq.heappush(
            self._retries,
            Retry(time.monotonic() + delay_s, next(self._seq), req.task, req.sample_index, req.attempt + 1),
        )

    def _stop(self, reason: str, by: str) -> None:
        if self._stopped:
            return
        self._stopped, self._stopped_by = reason, by
        # info, not error: the CLI prints the reason once, as the run's one message about it.
        # The loop ends at its next turn; the sessions in flight are cancelled at close
        # (``_cancel_in_flight``), once their workers have said what they did so far.
        log.info("stopping the run: %s", reason)

    def _note_death(self, index: int, submitted_at: float) -> None:
        """Record a worker's death once per burst: sessions sent before it died do not move the mark."""
        died_at = self._worker_died_at.get(index)
        if died_at is None or submitted_at > died_at:
            self._worker_died_at[index] = time.monotonic()

    def _lost(self, req: SessionRequest, message: str, known: dict[str, Any]) -> pa.RecordBatch:
        cfg = self.cfg
        return rows_to_batch([lost_row(req, cfg.harness.name, cfg.sandbox.provider, message, known)])

    def _cancel_in_flight(self, progress: Progress) -> None:
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
                self._settle(ref, progress)
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
