"""The driver loop: bounded admission, results as they complete, the policy's decision, bounded retries."""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import logging
import queue
import random
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
import yaml
from ray.exceptions import (
    RayError,
)

from executor import capacity, orphans, phases, stopping, warm
from executor.admission import Admission
from executor.config import RunConfig
from executor.decisions import training_reward_stats
from executor.driver_results import Results
from executor.driver_types import Announcement, Retry, RunSummary, Submission
from executor.export import SUBMITTED_TASKS
from executor.placement import Placements
from executor.progress import Progress
from executor.ray_connection import attached_lease, connect_ray, leave_ray, worker_options

# Where callers (the CLI, tests, benches) have always found these: executor/ray_connection.py holds them.
from executor.ray_connection import close_workers as close_workers
from executor.ray_connection import left_connected as left_connected
from executor.ray_connection import stop_own_ray as stop_own_ray
from executor.reaper import reap_quietly
from executor.runs import run_lock
from executor.schema import warm_up
from executor.session import SessionRequest
from executor.storage import describe_error, locate
from executor.store import ResumeState, RunStore, StoreError, iter_rows_newest_first, read_table
from executor.tasks import load_tasks
from executor.worker import RemoteSandboxWorker
from harnesses.install import default_cache_root
from harnesses.registry import make_harness
from policy import (
    KIND_INFO,
    CircuitBreaker,
    Decision,
    FailureKind,
    GroupBook,
    GroupMode,
    InFlightAction,
    Verdict,
)

log = logging.getLogger(__name__)

WAIT_S = 0.25


class Driver(Results):
    """One run's driver: bounded admission of sessions to worker actors, each result as it completes, the
    policy's decision, bounded retries, rows to the store. Driven from outside, one turn at a time, by
    ``executor.api.Executor`` (the ``rollout run`` command's and a trainer's loop): ``open``, then
    ``submit`` / ``announce`` / ``step`` until ``step`` says there is nothing left, then ``close``. All of
    it from one thread.

    ``sink``: called with every part file's final rows, once that part is written (a trainer's stream;
    a group never spans two part files). ``backlog``: rows handed to the sink and not yet taken; while
    they and the rows decided for it but not yet written reach ``max_backlog``, no session is admitted
    (the trainer's backpressure). ``policy_version``: the trainer's first version (None: no versions).
    ``export_form``: what the sink gets is in ``rollout export --all``'s schema (the task's prompt and
    metadata, the model asked, the train and decision columns), else the stored row."""

    def __init__(
        self,
        cfg: RunConfig,
        worker_class: Any = RemoteSandboxWorker,
        *,
        exiting: bool = False,
        sink: Callable[[pa.RecordBatch], None] | None = None,
        backlog: Callable[[], int] | None = None,
        max_backlog: int = 0,
        policy_version: int | None = None,
        progress: bool = True,
        export_form: bool = False,
    ) -> None:
        """``worker_class``: the Ray actor class hosting sessions (benchmarks swap in a null one).
        ``exiting``: the process ends once the run is closed (``rollout run``; see ``leave_ray``)."""
        assert cfg.run_id
        self.cfg = cfg
        self.worker_class = worker_class
        self.exiting = exiting
        self.run_dir = locate(cfg.out) / cfg.run_id
        self.store = RunStore(self.run_dir, on_written=self._delivered)
        self.rng = random.Random()
        self.sink = sink
        self.undelivered = 0  # final rows decided for the sink, in the store's buffer still
        self._export_form = export_form
        # For the export form: each open task's (prompt, metadata JSON), and each version's model name.
        self._task_info: dict[str, tuple[str, str]] = {}
        self._models: dict[int | None, str] = {policy_version: cfg.model.name}
        self._backlog = backlog
        self._max_backlog = max_backlog
        self._show_progress = progress
        self._seq = itertools.count()
        self._retries: list[Retry] = []
        self._inflight: dict[ray.ObjectRef, tuple[SessionRequest, int]] = {}
        # Each session's ref once its result is in, put there by Ray's thread (``_submit``): the loop
        # takes what came instead of asking Ray about every session in flight at every turn, a cost that
        # grew with the sessions in flight (~2 ms a turn at 1,000, several turns a second).
        self._done: queue.SimpleQueue[ray.ObjectRef] = queue.SimpleQueue()
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
        self._watch: capacity.Watch | None = None
        self.breaker = CircuitBreaker(cfg.policy.breaker)
        self.admission = Admission(cfg.in_flight_cap, cfg.concurrency.admission)
        # (request, batch, verdict) of final rows waiting for the rest of their group; see policy/groups.py
        self.groups: GroupBook[tuple[SessionRequest, pa.RecordBatch, Verdict]] = GroupBook()
        self._group_mode: dict[str, GroupMode] = {}  # per task with an open group
        self._sources: deque[Iterator[SessionRequest]] = deque()
        self._open_tasks: dict[
            str, int
        ] = {}  # task id -> its samples not final yet (submitted twice: skipped)
        self._expected = 0
        self._duplicates = 0
        self._snapshots = 0
        self._exits = contextlib.ExitStack()
        self.state = ResumeState()
        self.budget = 0
        self.progress: Progress | None = None
        # Policy versions (executor/api.py); None: the run has none.
        self._policy: Announcement | None = (
            Announcement(policy_version) if policy_version is not None else None
        )
        self._superseded: set[ray.ObjectRef] = set()  # cancelled for staleness: started again, no row
        self._reruns: dict[tuple[str, int], int] = {}  # staleness reruns per sample; (task, -1) per group
        self.versions: dict[str, int] = {"stale_masked": 0, "stale_rerun": 0, "stale_delivered": 0}
        self.versions["cancelled_superseded"] = 0

    # -- the run's life ----------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int | None:
        return self._policy.version if self._policy else None

    @property
    def stopped(self) -> str | None:
        return self._stopped

    def open(self, first: Submission | None = None, *, signals: bool = False) -> None:
        """Take the run's lock (RunLockedError, with nothing written, if another driver holds it), join
        or start Ray, start the workers, read what a previous run of this id left, and submit ``first``
        (its tasks counted meanwhile). On failure, what was taken is let go of. ``signals``: SIGTERM and
        SIGINT stop the run in order until it is closed (a command's run; executor/stopping.py)."""
        self._exits.enter_context(run_lock(self.run_dir))
        if signals:
            self._exits.callback(stopping.release)
        # Under the lock still when leaving: the next driver of this run starts once our sandboxes are gone.
        self._exits.callback(lambda: leave_ray(self._own_ray, self._workers, exiting=self.exiting))
        self._exits.callback(self._reap_dead_workers)
        self._exits.callback(self._await_cancelled)
        try:
            self._open(first, signals)
        except BaseException:
            self._exits.close()
            raise

    def _open(self, first: Submission | None, signals: bool) -> None:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-plan") as pool:
            # The run's own work before its first session (resume scan, config and task snapshot, task
            # count, harness check) is disk and subprocess waits: it goes on beside Ray's start and the
            # worker actors' (each a fresh process importing our modules), not before them.
            planned = pool.submit(self._plan, first)
            self._own_ray = connect_ray(self.cfg, signals=signals)
            phases.mark("ray_up")
            capacity.check(self.cfg.concurrency.worker_resources, self.cfg.concurrency.workers)
            self._workers = self._start_workers()
            phases.mark("workers_created")
            resumable = planned.result()
        self._load = [0] * len(self._workers)
        self._watch = capacity.Watch(self.cfg.concurrency.worker_resources, len(self._workers))
        self.budget = max(self.cfg.policy.retry_budget - self.state.retries_used, 0)
        self.progress = Progress(
            self.cfg.run_id or "",
            first.pending if first else 0,
            stream=None if self._show_progress else _Null(),
        )
        if not resumable:
            # The run this resumes stopped at a bound that still holds: more sessions would only burn more.
            self._expected += first.expected if first else 0
            self._stop(self.breaker.tripped or "", "breaker")
        elif first is not None:
            self._queue(first)

    def submit(self, sub: Submission) -> None:
        """More tasks to run (counted here; their sessions are admitted as the run goes). Tasks whose
        samples are all final already (a resume) are skipped; a task already running is skipped too."""
        sub.count(self.state.final)
        if self.progress is not None and self.progress.total is not None:
            self.progress.total += sub.pending
        self._queue(sub)

    def _queue(self, sub: Submission) -> None:
        self._expected += sub.expected
        if sub.snapshot:
            self._snapshot(sub)
        self._sources.append(self._requests(sub))

    def step(self) -> bool:
        """One turn of the loop: admit what may start, wait (at most WAIT_S) for results and settle
        them. False once there is nothing left: nothing in flight, waiting or submitted, or the run
        stopped. A KeyboardInterrupt or a StoreError stops the run; the caller then closes it."""
        assert self.progress is not None
        try:
            return self._step(self.progress)
        except KeyboardInterrupt:
            self._stop("interrupted", "interrupted")
        except StoreError as exc:
            self._stop(f"output: {exc}", "store")
        return False

    def _step(self, progress: Progress) -> bool:
        if (signum := stopping.requested()) is not None and not self._stopped:
            self._signal = signum
            self._stop(f"stopped by {signal.Signals(signum).name}", "signal")
        if self._stopped:
            return False  # what is in flight is cancelled and written at close
        while len(self._inflight) < self.admission.cap and not self._stopped and not self._held():
            now = time.monotonic()
            if self._retries and self._retries[0].ready_at <= now:
                r = heapq.heappop(self._retries)
                self._submit(SessionRequest(self.cfg.run_id or "", r.task, r.sample_index, r.attempt))
                continue
            nxt = self._next_request()
            if nxt is None:
                break
            self._submit(nxt)
        if self.undelivered and self._held() and not self._stopped and not self._held(written=0):
            # Held by rows decided but not yet written: write them now, for the trainer to take, rather
            # than hold admission for the rest of the flush interval (a trainer behind waits instead).
            self.store.flush()
        progress.in_flight = len(self._inflight)
        progress.waiting_retry = len(self._retries)
        if not self._inflight:
            if self._stopped or (not self._sources and not self._retries):
                # Nothing left: every decided row is written (and so handed on) before the run says so.
                self.store.flush()
                progress.tick()
                return False
            # Waiting for a retry's backoff, for the endpoint's Retry-After hold to pass, or for the
            # trainer to take what it was given.
            wait = self._retries[0].ready_at - time.monotonic() if self._retries else WAIT_S
            time.sleep(min(max(wait, 0.0), WAIT_S))
            self.store.maybe_flush()
            return True
        for ref in self._completed():
            if ref in self._inflight:  # else settled already, at a stop
                self._settle(ref, progress)
        self.placements.poll(self._workers, self._load)
        self.store.maybe_flush()
        if self._watch is not None:
            self._watch.tick()
            progress.cluster = self._watch.note
        progress.tick()
        return True

    def _completed(self) -> list[ray.ObjectRef]:
        """The sessions whose results came in: waits at most WAIT_S for the first, then takes the rest."""
        try:
            ready = [self._done.get(timeout=WAIT_S)]
        except queue.Empty:
            return []
        while True:
            try:
                ready.append(self._done.get_nowait())
            except queue.Empty:
                return ready

    def _held(self, written: int | None = None) -> bool:
        """Admission waits for the trainer: rows it has not taken, and (``written`` None) those decided
        and not yet written, reach the bound."""
        if self._backlog is None:
            return False
        pending = self.undelivered if written is None else written
        return self._backlog() + pending >= self._max_backlog

    def counts(self) -> dict[str, int]:
        """Sessions in flight, samples waiting for a retry, and whether submitted tasks wait to start."""
        return {
            "in_flight": len(self._inflight),
            "waiting_retry": len(self._retries),
            "submitted_waiting": int(bool(self._sources)),
        }

    def idle(self) -> bool:
        """Nothing in flight, waiting for a retry or submitted and not yet started."""
        return not self._inflight and not self._retries and not self._sources

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the run: no new session; at close, those in flight are cancelled (their sandboxes
        stopped) and written as ``cancelled`` rows, so their samples run again on resume."""
        self._stop(reason, "cancelled")

    def close(self) -> RunSummary:
        """Wait (bounded) for cancelled sessions to clean up, write what is buffered, write the summary,
        let go of Ray and of the run's lock. Sessions still in flight are cancelled first."""
        try:
            if self._inflight and not self._stopped:
                self._stop("closed with sessions in flight", "cancelled")
            if self.progress is not None:
                self._cancel_in_flight(self.progress)
            try:
                self.store.flush()
            except StoreError as exc:
                # These rows were never written, so their samples run again on resume; none is half-kept.
                log.error("buffered rows not written: %s", exc)
                self._stop(f"output: {exc}", "store")
            if self.progress is not None:
                self.progress.close()
            phases.mark("last_row")
            self._note_worker_ready(self._workers)
            return self._summarize()
        finally:
            self._exits.close()

    # -- policy versions ---------------------------------------------------------------------------------

    def announce(
        self, version: int, base_urls: tuple[str, ...] | None = None, model: str | None = None
    ) -> None:
        """The trainer's policy is now ``version`` (served at ``base_urls`` as ``model`` when given):
        sessions started from now on use it; every worker learns it for the calls of sessions already
        running. With ``in_flight: cancel``, sessions that could no longer be delivered within the
        staleness bound are cancelled and started again under it."""
        before = self._policy
        if before is not None and version <= before.version:
            raise ValueError(f"policy version {version}: must be greater than the current {before.version}")
        if base_urls and self.cfg.model.provider == "scripted":
            raise ValueError("base_url: the scripted model runs in each worker; a version cannot move it")
        self._policy = Announcement(
            version,
            base_urls or (before.base_urls if before else None),
            model or (before.model if before else None),
        )
        message = self._policy.to_json()
        self._models[version] = self._policy.model or self.cfg.model.name
        for worker in self._workers:
            announce = getattr(worker, "announce", None)
            if announce is not None:
                announce.remote(message)  # fire and forget: each session also carries its version
        rule = self.cfg.policy.staleness
        if rule.in_flight is InFlightAction.CANCEL:
            bound = rule.max_versions or 0
            for ref, (req, _) in self._inflight.items():
                if req.policy_version is not None and version - req.policy_version > bound:
                    self._superseded.add(ref)
                    ray.cancel(ref)

    # -- inside ------------------------------------------------------------------------------------------

    def _plan(self, first: Submission | None) -> bool:
        """Read what a previous run left and count ``first``; False when the run this resumes stopped at
        a bound that still holds. Writes the config (nothing before that check)."""
        cfg = self.cfg
        self.state = self.store.resume_state()
        if first is not None:
            first.count(self.state.final)
        if self.state.rows and self._restore_breaker():
            return False
        self._write_config()
        # What a driver killed outright left (before its first row, too): launches no row names.
        orphans.adopt(self.run_dir, self.state, cfg, self._append_cancelled)
        # Install once here so the first sessions don't all queue on the install lock.
        make_harness(cfg.harness.name, cfg.harness.version, cfg.harness.command).ensure_installed(
            default_cache_root()
        )
        warm_up()  # pyarrow's one-time costs, here rather than at the first row
        return True

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

    def _next_request(self) -> SessionRequest | None:
        while self._sources:
            nxt = next(self._sources[0], None)
            if nxt is not None:
                return nxt
            self._sources.popleft()
        return None

    def _requests(self, sub: Submission) -> Iterator[SessionRequest]:
        run_id = self.cfg.run_id or ""
        for task in sub.load():
            pending = [s for s in range(sub.samples) if (task.id, s) not in self.state.final]
            if not pending:
                continue
            if task.id in self._open_tasks:
                log.warning("task %s was submitted again while it runs: the second is skipped", task.id[:200])
                self._duplicates += sub.samples
                continue
            self._open_tasks[task.id] = len(pending)
            if self._export_form:
                self._task_info[task.id] = (task.prompt, json.dumps(task.metadata, sort_keys=True))
            if sub.group is not GroupMode.NONE:
                self.groups.expect(task.id, len(pending))
                self._group_mode[task.id] = sub.group
            for sample in pending:
                yield SessionRequest(
                    run_id, task, sample, self.state.last_attempt.get((task.id, sample), 0) + 1
                )

    def _submit(self, req: SessionRequest) -> None:
        workers = self._workers
        index = min(range(len(workers)), key=self._load.__getitem__)
        extra: dict[str, str] = {}
        if self._policy is not None:
            req = dataclasses.replace(req, policy_version=self._policy.version)
            extra["policy"] = self._policy.to_json()
        ref = workers[index].run.remote(
            req.task.model_dump_json(), req.sample_index, req.attempt, *self._binding, **extra
        )
        self._inflight[ref] = (req, index)
        # Called on Ray's thread (or here, if the result is in already) once the result or the error is;
        # the loop reads it with ray.get as before. The future holds the value only until the call.
        ref.future().add_done_callback(lambda _, ref=ref: self._done.put(ref))
        self.placements.dispatched(ref, req.rollout_id, index)
        self._submitted_at[ref] = time.monotonic()
        self._load[index] += 1

    def _reap_dead_workers(self) -> None:
        if self._worker_died_at:  # what dead workers left, on whichever node they ran
            reap_quietly(self.cfg.sandbox, everywhere=True)

    def _write_config(self) -> None:
        self.run_dir.mkdir()
        config = yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False)
        (self.run_dir / "config.yaml").write_text(config)
        if self.cfg.tasks is None:
            return  # the tasks come from a trainer's submissions, each kept under tasks/
        # A copy of the tasks beside the config, so `rollout replay` finds a row's task after the file moved.
        snapshot = self.run_dir / ("tasks.parquet" if self.cfg.tasks.endswith(".parquet") else "tasks.jsonl")
        if Path(self.cfg.tasks).is_dir():  # Harbor task directories: the tasks as they were read
            tasks = load_tasks(Path(self.cfg.tasks))
            snapshot.write_text("".join(t.model_dump_json(exclude_none=True) + "\n" for t in tasks))
        else:
            snapshot.put_file(Path(self.cfg.tasks))

    def _snapshot(self, sub: Submission) -> None:
        """A submission's tasks as a new file under tasks/ (export and replay read every one)."""
        folder = self.run_dir / SUBMITTED_TASKS
        if self._snapshots == 0:
            folder.mkdir()
            self._snapshots = len(folder.children())
        self._snapshots += 1
        name = f"{self._snapshots:06d}"
        try:
            if isinstance(sub.tasks, Path) and sub.tasks.is_file():
                suffix = ".parquet" if sub.tasks.suffix == ".parquet" else ".jsonl"
                (folder / (name + suffix)).put_file(sub.tasks)
            else:
                text = "".join(t.model_dump_json(exclude_none=True) + "\n" for t in sub.load())
                (folder / (name + ".jsonl")).write_text(text)
        except OSError as exc:
            raise StoreError(f"{folder}: could not keep the submitted tasks ({describe_error(exc)})") from exc

    def _summarize(self) -> RunSummary:
        table = read_table(
            self.run_dir,
            ["status", "failure_kind", "decision", "final", "task_id", "sample_index", "reward"],
        )
        cols = table.to_pydict()
        final_keys = {
            (t, s) for t, s, f in zip(cols["task_id"], cols["sample_index"], cols["final"], strict=True) if f
        }
        pending = max(self._expected - self._duplicates - len(final_keys), 0)
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
        if self._policy is not None:
            summary.versions = {"policy_version": self._policy.version, **self.versions}
        phases.mark("summary")
        summary.phases = phases.report()
        try:
            (self.run_dir / "summary.json").write_text(json.dumps(summary.__dict__, indent=2))
        except OSError as exc:  # a full disk must not hide the summary the caller prints
            log.error("summary.json not written: %s", exc.strerror or describe_error(exc))
        return summary


class _Null:
    """Where the progress of a run driven from a trainer goes when it asked for none."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False
