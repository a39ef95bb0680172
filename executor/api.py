"""The Python API: a run driven from a trainer's process, or from the ``rollout run`` command.

``Executor`` owns the driver's loop (``executor/driver.py`` holds what one turn of it does). The command
runs that loop in its own thread to the end of its task file (``run``). A trainer starts it in a thread
of its own (``start``) and talks to it from any other: it ``submit``s tasks without blocking, receives
the final rows as Arrow record batches once they are written (``batches``, ``abatches``), announces
each new policy version (``update_policy``), and ``close``s the run, which stops every sandbox. Rows are
handed on only once their part file is written, so a trainer sees each (task, sample) once: what a crash
or a close cut short runs again on resume and was never handed on. A GRPO group (``group=``) is handed on
whole, in one batch. While more than ``max_buffered_rows`` rows wait for the trainer, no new session
starts (backpressure: the sessions in flight finish, nothing more is admitted).

Inside a process that already runs Ray (a trainer's driver) the run joins that cluster; its workers are
ended at ``close``. See docs/training.md.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

from executor.config import RunConfig, config_from, load_config
from executor.driver import WAIT_S, Driver
from executor.driver_types import RunSummary, Submission
from executor.tasks import InputError, Task, task_at
from executor.worker import RemoteSandboxWorker
from policy import GroupMode

# How long ``close`` waits for the loop's thread to finish its turn and close the run (the driver's own
# bounds, the cancelled sessions' cleanup among them, come first).
CLOSE_JOIN_S = 300.0
# How long update_policy waits for the driver's loop to take the new version (a turn of it is at most
# WAIT_S of waiting for results and the settling of what came).
APPLY_WAIT_S = 60.0


class Executor:
    """One run. ``config``: a RunConfig, a mapping of its keys, or a YAML file (relative paths in it
    relative to the file; its stem the default run id). ``run_id`` and ``overrides`` (dotted keys, as
    ``rollout run``'s options) change it. ``policy_version``: the trainer's first version (None: the
    run has no versions). ``max_buffered_rows``: final rows waiting for the trainer past which no session
    starts (default: the run's in-flight cap). ``progress``: the live progress display on stderr.
    ``form``: the batches hold the rows as the run directory stores them (``rows``), or as
    ``rollout export --all`` writes them (``export``: with the task's prompt and metadata and the model
    name asked; token ids and logprobs in ``model_calls`` either way, with ``gateway.capture_tokens``)."""

    def __init__(
        self,
        config: RunConfig | Mapping[str, Any] | str | Path,
        *,
        run_id: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        policy_version: int | None = None,
        max_buffered_rows: int | None = None,
        progress: bool = False,
        form: Literal["rows", "export"] = "rows",
        worker_class: Any = RemoteSandboxWorker,
        exiting: bool = False,
    ) -> None:
        self.config = _config(config, run_id, overrides or {})
        if form not in ("rows", "export"):
            raise InputError(f"form: {form!r} is not one of rows, export")
        cap = max_buffered_rows if max_buffered_rows is not None else self.config.in_flight_cap
        if cap < 1:
            raise InputError(f"max_buffered_rows: {cap} must be at least 1")
        self._version = policy_version
        self._lock = threading.Condition()
        self._ready: collections.deque[pa.RecordBatch] = collections.deque()
        self._buffered = 0
        self._delivered = 0
        self._commands: collections.deque[tuple[str, Any]] = collections.deque()
        self._asked = 0  # commands given; the loop is idle for them once _idle_at equals it
        self._idle_at = -1
        self._applied = 0  # commands the loop has carried out, in the order given
        self._thread: threading.Thread | None = None
        self._closing = False
        self._error: BaseException | None = None
        self._summary: RunSummary | None = None
        self.driver = Driver(
            self.config,
            worker_class,
            exiting=exiting,
            sink=self._deliver,
            backlog=lambda: self._buffered,
            max_backlog=cap,
            policy_version=policy_version,
            progress=progress,
            export_form=form == "export",
        )

    # -- the command's way: the config's task file, to its end -----------------------------------------

    def run(self) -> RunSummary:
        """Run (or resume) the config's task file to its end in this thread; the summary. RunLockedError,
        with nothing written, if another driver holds the run."""
        cfg = self.config
        if cfg.tasks is None:
            raise InputError("tasks: run() runs the config's task file, and the config names none")
        first = Submission(Path(cfg.tasks), cfg.samples, cfg.policy.group, snapshot=False)
        self.driver.sink = None  # nobody reads the rows here but the store
        self.driver.open(first, signals=True)
        try:
            while self.driver.step():
                pass
        finally:
            self._summary = self.driver.close()
        return self._summary

    # -- a trainer's way -------------------------------------------------------------------------------

    def start(self) -> Executor:
        """Take the run (RunLockedError, with nothing written, if another driver holds it), join or
        start Ray and start the workers, in this thread (Ray wants its first call on the main thread);
        then drive the run from a thread of its own."""
        if self._thread is not None:
            raise RuntimeError("the executor is already started")
        self.driver.open()
        self._thread = threading.Thread(target=self._loop, name="rollout-driver", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> Executor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        tasks: str | Path | Iterable[Task | Mapping[str, Any]],
        *,
        samples: int | None = None,
        group: GroupMode | str | None = None,
    ) -> None:
        """Run ``tasks`` (a task file, or tasks as ``Task``s or mappings of a task line's keys), each
        ``samples`` times (the config's ``samples`` by default) under the group policy ``group`` (the
        config's ``policy.group``). Returns at once. A (task, sample) already final in this run is not
        run again (resume); a task submitted again while it runs is skipped, with a warning."""
        count = samples if samples is not None else self.config.samples
        if not 1 <= count <= 10_000:
            raise InputError(f"samples: {count} is not between 1 and 10000")
        mode = GroupMode(group) if group is not None else self.config.policy.group
        if isinstance(tasks, str | Path):
            path = Path(tasks)
            if not path.exists():
                raise InputError(f"{path}: no such task file")
            source: Path | list[Task] = path
        else:
            seen: set[str] = set()
            source = [
                task_at(
                    t.model_dump(exclude_none=True) if isinstance(t, Task) else dict(t), f"task {i}", seen
                )
                for i, t in enumerate(tasks)
            ]
        self._command("submit", Submission(source, count, mode))

    def update_policy(
        self, version: int, *, base_url: str | list[str] | None = None, model: str | None = None
    ) -> None:
        """The trainer's policy is now ``version`` (greater than the last), served at ``base_url`` (one
        URL or several replicas) as ``model`` where those change. Sessions started from now on use it;
        calls of running sessions at the same endpoint are answered by it. What happens to rows that
        started too many versions ago, and to sessions in flight, is ``policy.staleness``'s. Returns once
        the driver has taken it: every row that lands after is decided under it."""
        if self._version is not None and version <= self._version:
            raise InputError(f"policy version {version}: must be greater than the current {self._version}")
        if base_url and self.config.model.provider == "scripted":
            raise InputError("base_url: the scripted model runs in each worker; a version cannot move it")
        urls = None if base_url is None else tuple([base_url] if isinstance(base_url, str) else base_url)
        self._version = version
        # Taken by the driver before this returns: a row that lands later is decided under this version
        # (a session the trainer lets finish now, say), not under the one before.
        self._wait_applied(self._command("announce", (version, urls, model)), f"policy version {version}")

    @property
    def policy_version(self) -> int | None:
        return self._version

    def batches(self, timeout_s: float | None = None) -> Iterator[pa.RecordBatch]:
        """Final rows (accepted and masked, each with its decision) as they are written, until all that
        was submitted is final and handed on, or the run stopped. ``timeout_s``: TimeoutError when no
        batch came for that long."""
        while (batch := self.next_batch(timeout_s)) is not None:
            yield batch

    async def abatches(self, timeout_s: float | None = None) -> AsyncIterator[pa.RecordBatch]:
        """``batches`` for an event loop: the waiting happens in a thread, never on the loop."""
        while (batch := await asyncio.to_thread(self.next_batch, timeout_s)) is not None:
            yield batch

    def next_batch(self, timeout_s: float | None = None) -> pa.RecordBatch | None:
        """The next batch of final rows; None once nothing more will come of what was submitted."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"the run's driver failed: {self._error}") from self._error
                if self._ready:
                    batch = self._ready.popleft()
                    self._buffered -= batch.num_rows
                    self._delivered += batch.num_rows
                    return batch
                if self._thread is None or not self._thread.is_alive() or self._idle_at == self._asked:
                    return None
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no rows within {timeout_s:g} s")
                self._lock.wait(WAIT_S)

    def stats(self) -> dict[str, Any]:
        """Counts for a trainer's log: rows waiting for it, rows handed on, sessions in flight (read as
        the loop leaves them; a turn may be under way), the policy version."""
        with self._lock:
            return {
                "buffered_rows": self._buffered,
                "delivered_rows": self._delivered,
                **self.driver.counts(),
                "policy_version": self._version,
                "stopped": self.driver.stopped,
            }

    def cancel(self) -> None:
        """Stop the run: no session starts, those in flight are cancelled (their sandboxes stopped) and
        write nothing; their samples run again when the run is resumed. ``close`` still follows."""
        self._command("cancel", None)

    def close(self) -> RunSummary:
        """End the run: sessions still in flight are cancelled (their samples run again on resume),
        buffered rows are written, every sandbox is stopped, the workers are ended, the run's lock is let
        go of. Rows written and not yet taken stay readable in the run directory. Idempotent."""
        if self._summary is not None:
            return self._summary
        if self._thread is None:
            raise RuntimeError("the executor was never started")
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join(CLOSE_JOIN_S)
        if self._thread.is_alive():
            raise RuntimeError(f"the run's driver did not close within {CLOSE_JOIN_S:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"the run's driver failed: {self._error}") from self._error
        assert self._summary is not None
        return self._summary

    # -- the loop's thread -------------------------------------------------------------------------------

    def _command(self, name: str, payload: Any) -> int:
        """Queue a command for the loop; its number, which ``_wait_applied`` takes."""
        with self._lock:
            if self._closing or self._summary is not None:
                raise RuntimeError("the executor is closed")
            self._commands.append((name, payload))
            self._asked += 1
            self._lock.notify_all()
            return self._asked

    def _wait_applied(self, number: int, what: str) -> None:
        """Until the loop has carried out command ``number`` (a loop not started yet takes it first
        thing), bounded by APPLY_WAIT_S; the driver's failure is the caller's."""
        deadline = time.monotonic() + APPLY_WAIT_S
        with self._lock:
            while self._applied < number and self._thread is not None and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what}: the driver did not take it within {APPLY_WAIT_S:.0f} s")
                self._lock.wait(min(left, WAIT_S))
            if self._error is not None:
                raise RuntimeError(f"the run's driver failed: {self._error}") from self._error

    def _deliver(self, batch: pa.RecordBatch) -> None:
        with self._lock:
            self._ready.append(batch)
            self._buffered += batch.num_rows
            self._lock.notify_all()

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing:
                        break
                    commands, seen = list(self._commands), self._asked
                    self._commands.clear()
                for name, payload in commands:
                    self._apply(name, payload)
                with self._lock:
                    self._applied = seen
                    self._lock.notify_all()
                if self.driver.step():
                    continue
                with self._lock:  # nothing left of what was asked: wait for more, bounded, and look again
                    self._idle_at = seen
                    self._lock.notify_all()
                    if not self._commands and not self._closing:
                        self._lock.wait(WAIT_S)
        except BaseException as exc:  # handed to the trainer by next_batch and close
            with self._lock:
                self._error = exc
        finally:
            try:
                self._summary = self.driver.close()
            except BaseException as exc:
                self._error = self._error or exc
            with self._lock:
                self._idle_at = self._applied = self._asked
                self._lock.notify_all()

    def _apply(self, name: str, payload: Any) -> None:
        if name == "submit":
            self.driver.submit(payload)
        elif name == "announce":
            self.driver.announce(*payload)
        elif name == "cancel":
            self.driver.cancel()


def _config(
    config: RunConfig | Mapping[str, Any] | str | Path, run_id: str | None, overrides: Mapping[str, Any]
) -> RunConfig:
    given = {**overrides, **({"run_id": run_id} if run_id else {})}
    if isinstance(config, str | Path):
        return load_config(Path(config), given)
    data = config.model_dump(mode="json") if isinstance(config, RunConfig) else dict(config)
    cfg = config_from(data, "config", given)
    if not cfg.run_id:
        raise InputError("config: run_id is required (the same id resumes the run)")
    return cfg


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value
