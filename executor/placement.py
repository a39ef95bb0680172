"""What was known of a session while it ran, so that a row the session never returned (its worker or
node died, the run was stopped) still says where and when it ran.

The worker keeps each running session's row as ``run_session`` fills it (``SessionContext.live``) and
answers ``SandboxWorker.sessions()`` with a snapshot of them (``snapshot``). The driver asks each worker
with sessions in flight every ``POLL_S``, without waiting on the answer, and keeps the last one
(``Placements``); it knows on its own when it dispatched each session and to which worker. A session that
started after the last answer has its dispatch time and, when learned since, its worker's node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayError

POLL_S = 2.0
TURN_S = 0.25  # how often the driver's loop looks at all
REFRESH_S = 1.0  # at a stop: the last word of the workers, within `ray job stop`'s 3 s before SIGKILL
# The columns of a row a snapshot carries: placement and the phase times reached so far.
PLACEMENT_FIELDS = (
    "node_id",
    "worker_id",
    "sandbox_id",
    "sandbox_isolation",
    "harness_version",
    "version_tested",
    "evidence_dir",
)
PHASES = {"setup": "t_setup_s", "agent": "t_agent_s", "verify": "t_verify_s"}


def snapshot(live: dict[str, tuple[Any, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """The worker's side: each running session's placement, start (epoch seconds) and phase times so far,
    from its row and its timer's marks."""
    out: dict[str, dict[str, Any]] = {}
    for rollout_id, (row, marks) in list(live.items()):
        known: dict[str, Any] = {name: getattr(row, name, None) for name in PLACEMENT_FIELDS}
        known["started_at"] = row.started_at.timestamp() if row.started_at is not None else None
        known.update({column: marks[phase] for phase, column in PHASES.items() if phase in marks})
        out[rollout_id] = known
    return out


@dataclass
class _Dispatch:
    rollout_id: str
    worker: int
    at: float  # epoch seconds


@dataclass
class _Worker:
    identity: dict[str, Any] = field(default_factory=dict)  # node_id, worker_id of its latest answer
    learned_at: float = 0.0
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    asking: Any = None  # the ref of the question in flight
    asked_at: float = float("-inf")  # monotonic
    asked_epoch: float = 0.0


class Placements:
    """The driver's side: what each session in flight was last known to be doing."""

    def __init__(self) -> None:
        self._dispatched: dict[Any, _Dispatch] = {}
        self._workers: dict[int, _Worker] = {}
        self._turn = float("-inf")

    def dispatched(self, ref: Any, rollout_id: str, worker: int) -> None:
        self._dispatched[ref] = _Dispatch(rollout_id, worker, time.time())

    def known(self, ref: Any) -> dict[str, Any]:
        """What was known of the session ``ref`` names, as row columns; forgets it."""
        sent = self._dispatched.pop(ref, None)
        if sent is None:
            return {}
        worker = self._workers.get(sent.worker)
        if worker is not None and sent.rollout_id in worker.sessions:
            known = dict(worker.sessions[sent.rollout_id])
        else:
            known = {"started_at": sent.at}
            # A worker's identity learned before the dispatch may be that of an incarnation since gone.
            if worker is not None and worker.learned_at >= sent.at:
                known.update(worker.identity)
        if known.get("started_at") is not None:
            known["t_total_s"] = round(max(time.time() - known["started_at"], 0.0), 4)
        return {k: v for k, v in known.items() if v is not None}

    def running(self) -> dict[str, dict[str, Any]]:
        """Every session the workers last said they run, by rollout id, as they said it."""
        return {rid: known for w in self._workers.values() for rid, known in w.sessions.items()}

    def poll(self, workers: list[Any], load: list[int]) -> None:
        """Take in the answers that came, and ask each busy worker (``load``: its sessions in flight)
        again once ``POLL_S`` has passed since it was last asked. Never waits; does anything only every
        ``TURN_S``, so that the driver's loop pays for it a few times a second, whatever its pace."""
        now = time.monotonic()
        if now - self._turn < TURN_S:
            return
        self._turn = now
        asking = {w.asking: w for w in self._workers.values() if w.asking is not None}
        if asking:
            ready, _ = ray.wait(list(asking), num_returns=len(asking), timeout=0)
            for ref in ready:
                self._take(asking[ref], ref)
        for index, sessions in enumerate(load):
            if not sessions:
                continue
            state = self._workers.setdefault(index, _Worker())
            if state.asking is None and now - state.asked_at >= POLL_S:
                ask = getattr(workers[index], "sessions", None)  # a benchmark's null worker has none
                if ask is not None:
                    state.asking, state.asked_at, state.asked_epoch = ask.remote(), now, time.time()

    def refresh(self, workers: list[Any], busy: list[int], timeout_s: float = REFRESH_S) -> None:
        """Ask each busy worker now and wait for the answers, at most ``timeout_s``: at a stop, so that
        the rows written for its sessions hold what they did up to it."""
        asked: dict[Any, _Worker] = {}
        for index in busy:
            ask = getattr(workers[index], "sessions", None)
            if ask is not None:
                state = self._workers.setdefault(index, _Worker())
                state.asking, state.asked_at, state.asked_epoch = ask.remote(), time.monotonic(), time.time()
                asked[state.asking] = state
        if asked:
            ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout_s)
            for ref in ready:
                self._take(asked[ref], ref)

    @staticmethod
    def _take(state: _Worker, ref: Any) -> None:
        state.asking = None
        try:
            answer = ray.get(ref, timeout=0)
        except (RayError, TimeoutError):
            return  # a worker gone: what it said before is what is known
        if isinstance(answer, dict):
            state.identity = {k: answer.get(k) for k in ("node_id", "worker_id")}
            state.learned_at = state.asked_epoch  # the incarnation that answered was alive then
            state.sessions = answer.get("sessions") or {}
