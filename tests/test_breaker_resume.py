"""The circuit breaker rebuilt on resume from the part files a run wrote, as if the run had never stopped."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from executor.config import RunConfig
from executor.driver import Driver
from executor.schema import rows_to_batch
from executor.store import RunStore, iter_rows_newest_first, part_files, read_table
from policy import KIND_INFO, BreakerConfig, CircuitBreaker, FailureKind
from tests.chaos.conftest import OK_SCRIPT, run, write_config, write_tasks

KINDS = ["none", "none", "none", "transport_error", "sandbox_start_failed", "model_request_error"]
OFF = {"max_masked_fraction": None, "max_consecutive_infra": None}


def _row(i: int, kind: str, decision: str) -> dict[str, Any]:
    return {
        "run_id": "r",
        "rollout_id": f"t{i}.s0.a1",
        "task_id": f"t{i}",
        "sample_index": 0,
        "attempt": 1,
        "status": "completed" if kind == "none" else "failed",
        "failure_kind": kind,
        "decision": decision,
        "final": decision != "retry",
    }


def _history(n: int, seed: int, infra_tail: int = 0) -> list[dict[str, Any]]:
    """``n`` rows of mixed outcomes, then ``infra_tail`` infrastructure failures in a row."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = rng.choice(KINDS)
        decision = "accept" if kind == "none" else rng.choice(["mask", "mask", "retry"])
        rows.append(_row(i, kind, decision))
    rows += [_row(n + i, "transport_error", "retry") for i in range(infra_tail)]
    return rows


def _feed(breaker: CircuitBreaker, row: dict[str, Any]) -> str | None:
    """What the driver does for each row it settles and writes."""
    kind = row["failure_kind"]
    breaker.record_attempt(KIND_INFO[FailureKind(kind)].infrastructure, kind)
    if row["final"]:
        breaker.record_final(row["decision"] == "mask")
    return breaker.tripped


def _write(run_dir: Path, rows: list[dict[str, Any]], flush_rows: int = 7) -> None:
    store = RunStore(run_dir, flush_rows=flush_rows)
    for row in rows:
        store.append(rows_to_batch([row]))
    store.flush()


def _restored(tmp_path: Path, run_id: str, breaker: dict[str, Any]) -> CircuitBreaker:
    cfg = RunConfig(tasks=str(tmp_path / "tasks.jsonl"), out=str(tmp_path), run_id=run_id)
    cfg.policy.breaker = BreakerConfig(**breaker)
    driver = Driver(cfg)
    driver._restore_breaker()
    return driver.breaker


def _state(breaker: CircuitBreaker) -> tuple[dict[str, object], list[bool]]:
    return breaker.report(), list(breaker._window)


@pytest.mark.parametrize("seed", range(6))
def test_restored_state_equals_an_uninterrupted_run(tmp_path, seed):
    config = {"window": 10, "min_rows": 5, **OFF}
    rows = _history(40 + seed * 13, seed, infra_tail=seed % 3 * 4)
    uninterrupted = CircuitBreaker(BreakerConfig(**config))
    for row in rows:
        _feed(uninterrupted, row)
    _write(tmp_path / "r", rows)
    assert len(part_files(tmp_path / "r" / "rows")) > 3
    restored = _restored(tmp_path, "r", config)
    assert _state(restored) == _state(uninterrupted)
    assert restored.report()["window_rows"] == 10 and restored.tripped is None


@pytest.mark.parametrize(
    "bounds",
    [
        {"window": 8, "min_rows": 8, "max_masked_fraction": 0.5, "max_consecutive_infra": None},
        {"window": 8, "min_rows": 8, "max_masked_fraction": None, "max_consecutive_infra": 5},
    ],
)
def test_a_run_that_stopped_at_a_bound_is_tripped_again(tmp_path, bounds):
    uninterrupted = CircuitBreaker(BreakerConfig(**bounds))
    written = []
    for row in _history(200, 7, infra_tail=5):
        written.append(row)
        if _feed(uninterrupted, row):
            break  # the driver stops here; what it settles after is not what this checks
    assert uninterrupted.tripped
    _write(tmp_path / "r", written)
    restored = _restored(tmp_path, "r", bounds)
    assert restored.tripped == uninterrupted.tripped
    assert _state(restored) == _state(uninterrupted)
    # Resumed under a looser bound, the same rows do not stop the run.
    looser = {**bounds, **{k: None for k in OFF if bounds[k] is not None}}
    assert _restored(tmp_path, "r", looser).tripped is None


def test_restore_reads_back_only_as_far_as_the_window_and_the_streak(tmp_path):
    rows = _history(600, 3, infra_tail=12)
    _write(tmp_path / "r", rows, flush_rows=10)
    read = 0

    def counted() -> Iterator[tuple[bool, str, bool, bool]]:
        nonlocal read
        for kind, decision, final in iter_rows_newest_first(
            tmp_path / "r" / "rows", ["failure_kind", "decision", "final"]
        ):
            read += 1
            yield KIND_INFO[FailureKind(kind)].infrastructure, kind, final, decision == "mask"

    config = BreakerConfig(window=20, min_rows=20, **OFF)
    restored = CircuitBreaker(config)
    restored.restore(counted())
    uninterrupted = CircuitBreaker(config)
    for row in rows:
        _feed(uninterrupted, row)
    assert _state(restored) == _state(uninterrupted)
    assert restored.consecutive_infra >= 12
    assert read < 100, read  # of 612 rows in 62 part files


# -- through real runs --------------------------------------------------------------------------------------

TRIP = {"window": 4, "min_rows": 4, "max_masked_fraction": 0.5, "max_consecutive_infra": None}
NO_RETRY = {"rules": {"sandbox_start_failed": {"retry": False}}}


def _summary(tmp_path: Path, run_id: str) -> dict[str, Any]:
    return json.loads((tmp_path / "out" / run_id / "summary.json").read_text())


def _parts(tmp_path: Path, run_id: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in part_files(tmp_path / "out" / run_id / "rows")}


@pytest.mark.integration
@pytest.mark.usefixtures("codex_installed")
def test_a_tripped_run_resumed_with_more_tasks_stops_at_once(tmp_path):
    def cfg(n: int) -> Path:
        tasks = write_tasks(tmp_path / f"tasks{n}.jsonl", n, lambda i: OK_SCRIPT)
        policy = {"breaker": TRIP, **NO_RETRY}
        return write_config(tmp_path, "trip", tasks, sandbox={"inject_start_failures": 1.0}, policy=policy)

    first = run(cfg(6))
    assert first.returncode == 1, first.stderr[-2000:]
    tripped = _summary(tmp_path, "trip")
    assert tripped["stopped_by"] == "breaker" and tripped["breaker"]["tripped"]
    before = _parts(tmp_path, "trip")
    second = run(cfg(12))
    assert second.returncode == 1, second.stderr[-2000:]
    summary = _summary(tmp_path, "trip")
    assert summary["stopped_by"] == "breaker"
    assert summary["stopped"] == summary["breaker"]["tripped"] == tripped["breaker"]["tripped"]
    assert "run stopped: circuit breaker" in second.stdout + second.stderr
    assert _parts(tmp_path, "trip") == before  # not one session ran
    assert summary["rows"] == tripped["rows"] and summary["pending"] == 12 - summary["final"]


@pytest.mark.integration
@pytest.mark.usefixtures("codex_installed")
def test_a_resumed_run_goes_on_from_the_breaker_state_it_left(tmp_path):
    breaker = {"window": 10, "min_rows": 10, "max_masked_fraction": 0.9, "max_consecutive_infra": 50}

    def cfg(n: int) -> Path:
        tasks = write_tasks(tmp_path / f"tasks{n}.jsonl", n, lambda i: OK_SCRIPT)
        # Every fourth sandbox start fails (counted, not drawn) and is masked, not retried.
        sandbox = {"inject_start_failures": 0.25}
        return write_config(tmp_path, "go", tasks, sandbox=sandbox, policy={"breaker": breaker, **NO_RETRY})

    first = run(cfg(8))
    assert first.returncode == 0, first.stderr[-2000:]
    assert _summary(tmp_path, "go")["masked"] >= 1
    second = run(cfg(14))
    assert second.returncode == 0, second.stderr[-2000:]
    uninterrupted = CircuitBreaker(BreakerConfig(**breaker))
    for row in read_table(tmp_path / "out" / "go").to_pylist():
        _feed(uninterrupted, row)
    report = _summary(tmp_path, "go")["breaker"]
    # The second run settled 6 rows; a breaker started empty would hold only those.
    assert report == uninterrupted.report() and report["window_rows"] == 10
