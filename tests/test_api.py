"""The Python API from a trainer's process that runs Ray already: rows streamed as their parts are written,
groups whole, backpressure, close leaving nothing running, resume exactly once; policy versions and
staleness (rerun, and in-flight sessions cancelled). Real Ray, real local sandboxes, the command harness
calling the scripted model through the gateway."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from executor import Executor
from executor.store import read_table
from tests.conftest import processes_under
from tests.test_command_harness import AGENT

pytestmark = pytest.mark.integration

FAST = [{"type": "text", "text": "42"}]
BOUND_S = 180.0


@pytest.fixture(scope="module")
def trainer_ray() -> Iterator[None]:
    """Ray as a trainer's driver has it: initialized before the executor is made."""
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _config(tmp_path: Path, run_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "out": str(tmp_path / "out"),
        "samples": 2,
        "harness": {"name": "command", "command": AGENT},
        "sandbox": {"root": str(tmp_path / "sb")},
        "limits": {"deadline_s": 60},
        "concurrency": {"workers": 1, "sessions_per_worker": 4},
        **extra,
    }


def _task(name: str, script: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": name, "prompt": name, "model_script": script, "verify": "grep -q 42 answer.txt"}


def _wait_for(what: str, condition: Any) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {BOUND_S:.0f} s: {what}"
        time.sleep(0.05)  # polling a condition, bounded; not synchronisation by sleeping


def _rows(batches: list[pa.RecordBatch]) -> list[dict[str, Any]]:
    return [
        r for b in batches for r in b.select(["task_id", "sample_index", "attempt", "decision"]).to_pylist()
    ]


def _whole_groups(batch: pa.RecordBatch, samples: int) -> bool:
    counts = Counter(batch.column("task_id").to_pylist())
    return all(n == samples for n in counts.values())


def test_stream_backpressure_close_and_resume_exactly_once(tmp_path, trainer_ray):
    held = [{"type": "wait", "gate": "never", "max_s": 120}, *FAST]
    tasks = [_task(f"a{i}", FAST) for i in range(3)] + [_task("slow", held)]
    # Two sessions at once, one group's worth: once a group is decided, nothing starts until it is read.
    cfg = _config(
        tmp_path,
        "stream",
        policy={"group": "mask_group"},
        concurrency={"workers": 1, "sessions_per_worker": 2},
    )

    ex = Executor(cfg, max_buffered_rows=2).start()
    workers = list(ex.driver._workers)
    ex.submit(tasks)
    # Nobody reads: the first groups fill the buffer, and then nothing more starts though tasks wait.
    _wait_for(
        "the run to hold with rows unread",
        lambda: (s := ex.stats())["buffered_rows"] >= 2 and s["in_flight"] == 0 and s["submitted_waiting"],
    )
    got: list[pa.RecordBatch] = []
    while len(_rows(got)) < 6:
        batch = ex.next_batch(timeout_s=BOUND_S)
        assert batch is not None and _whole_groups(batch, 2)
        got.append(batch)
    assert {r["task_id"] for r in _rows(got)} == {"a0", "a1", "a2"}
    _wait_for("the held sessions to start", lambda: ex.stats()["in_flight"] == 2)
    summary = ex.close()  # the slow group is in flight, held at the model
    assert summary.pending == 2 and summary.final == 6 and summary.stopped_by == "cancelled"
    assert not processes_under(str(tmp_path / "sb"))
    assert ray.is_initialized()  # the trainer's Ray is left as it was; the run's workers are gone
    for worker in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.info.remote(), timeout=30)

    # Resumed: what was handed on is not run again; the slow group (its task changed meanwhile) once.
    again = Executor(cfg).start()
    again.submit([_task(f"a{i}", FAST) for i in range(3)] + [_task("slow", FAST)])

    async def take() -> list[pa.RecordBatch]:
        return [b async for b in again.abatches(timeout_s=BOUND_S)]

    resumed = asyncio.run(take())
    assert again.close().pending == 0
    assert {(r["task_id"], r["decision"]) for r in _rows(resumed)} == {("slow", "accept")}
    stored = read_table(tmp_path / "out" / "stream").to_pylist()
    finals = [(r["task_id"], r["sample_index"]) for r in stored if r["final"]]
    delivered = [(r["task_id"], r["sample_index"]) for r in _rows(got + resumed)]
    assert sorted(finals) == sorted(delivered) and len(set(delivered)) == 8
    assert len({(r["task_id"], r["sample_index"], r["attempt"]) for r in stored}) == len(stored)
    assert len(list((tmp_path / "out" / "stream" / "tasks").iterdir())) == 2  # each submission kept
    assert not processes_under(str(tmp_path / "sb"))


def test_stale_rows_rerun_and_superseded_sessions_cancelled(tmp_path, trainer_ray):
    held = [{"type": "wait", "gate": "never", "max_s": 4}, *FAST]
    # rerun: a row decided two versions after its start runs again under the current version.
    rerun = _config(
        tmp_path, "rerun", samples=1, policy={"staleness": {"max_versions": 1, "action": "rerun"}}
    )
    ex = Executor(rerun, policy_version=0).start()
    ex.submit([_task("r", held)])
    _wait_for("the session to start", lambda: ex.stats()["in_flight"] == 1)
    ex.update_policy(1)
    # Taken by the driver when update_policy returns: a row landing after it is decided under it.
    assert ex.driver.policy_version == 1
    ex.update_policy(2)
    assert ex.driver.policy_version == 2
    rows = [r for b in ex.batches(timeout_s=BOUND_S) for r in b.to_pylist()]
    summary = ex.close()
    assert [(r["attempt"], r["policy_version"], r["staleness"], r["decision"]) for r in rows] == [
        (2, 2, 0, "accept")
    ]
    stored = read_table(tmp_path / "out" / "rerun").to_pylist()
    first = next(r for r in stored if r["attempt"] == 1)
    assert (first["policy_version"], first["staleness"], first["decision"], first["final"]) == (
        0,
        2,
        "retry",
        False,
    )
    assert first["decision_reason"].startswith("stale: started under policy version 0")
    assert summary.versions["stale_rerun"] == 1 and summary.versions["policy_version"] == 2

    # cancel: sessions that could no longer be delivered are stopped and started again, writing nothing.
    cancel = _config(
        tmp_path, "cancel", policy={"staleness": {"max_versions": 0, "action": "mask", "in_flight": "cancel"}}
    )
    ex = Executor(cancel, policy_version=5).start()
    ex.submit([_task("c", held)])
    _wait_for("the sessions to start", lambda: ex.stats()["in_flight"] == 2)
    ex.update_policy(6, model="policy-6")
    rows = [r for b in ex.batches(timeout_s=BOUND_S) for r in b.to_pylist()]
    summary = ex.close()
    assert sorted((r["sample_index"], r["attempt"], r["policy_version"], r["decision"]) for r in rows) == [
        (0, 1, 6, "accept"),
        (1, 1, 6, "accept"),
    ]
    assert all(c["policy_version"] == 6 for r in rows for c in r["model_calls"])
    assert summary.versions["cancelled_superseded"] == 2
    assert len(read_table(tmp_path / "out" / "cancel")) == 2  # the cancelled launches wrote no row
    assert not processes_under(str(tmp_path / "sb"))


def test_cancel_stops_what_runs_and_writes_it_as_cancelled(tmp_path, trainer_ray):
    held = [{"type": "wait", "gate": "never", "max_s": 120}, *FAST]
    ex = Executor(_config(tmp_path, "cancelled")).start()
    ex.submit([_task("h", held)])
    _wait_for("the sessions to start", lambda: ex.stats()["in_flight"] == 2)
    ex.cancel()
    assert list(ex.batches(timeout_s=BOUND_S)) == []  # the stream ends: nothing more will come
    summary = ex.close()
    assert (summary.stopped_by, summary.final, summary.pending) == ("cancelled", 0, 2)
    # What ran is on record as cancelled, not final: a resume runs those samples again.
    stored = read_table(tmp_path / "out" / "cancelled").to_pylist()
    assert (
        sorted((r["failure_kind"], r["decision"], r["final"]) for r in stored)
        == [("cancelled", "retry", False)] * 2
    )
    assert not processes_under(str(tmp_path / "sb"))
    with pytest.raises(RuntimeError, match="closed"):
        ex.submit([_task("late", FAST)])


def test_token_data_in_the_export_form_as_rollout_export_writes_it(tmp_path, trainer_ray):
    from executor.export import ALL_SCHEMA, export

    cfg = _config(tmp_path, "tokens", gateway={"capture_tokens": True, "top_logprobs": 0})
    with Executor(cfg, form="export", policy_version=4) as ex:
        ex.submit([_task("k", FAST)], group="mask_group")
        batches = list(ex.batches(timeout_s=BOUND_S))
    assert len(batches) == 1 and batches[0].schema.equals(ALL_SCHEMA, check_metadata=False)
    delivered = {r["rollout_id"]: r for r in batches[0].to_pylist()}
    assert len(delivered) == 2 and all(
        r["prompt"] == "k" and r["model"] == "scripted-model" for r in delivered.values()
    )
    assert all(r["policy_version"] == 4 and r["staleness"] == 0 for r in delivered.values())
    assert all(c["completion_token_ids"] for r in delivered.values() for c in r["model_calls"])
    export(tmp_path / "out" / "tokens", tmp_path / "train.parquet")
    exported = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(exported) == 2
    for row in exported:  # the export's columns hold the same values, token lists included
        assert {k: v for k, v in delivered[row["rollout_id"]].items() if k in row} == row


def test_a_run_over_two_replicas_keeps_each_session_on_one(tmp_path, trainer_ray):
    import threading

    from harnesses.testing.scripted_model import ScriptedModel, parse_steps

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    servers = [ScriptedModel(parse_steps([*FAST])) for _ in range(2)]
    for server in servers:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    urls = [server.base_url for server in servers]
    twice = AGENT.replace("print(answer)", "urllib.request.urlopen(req, timeout=30).read()\nprint(answer)")
    cfg = _config(
        tmp_path,
        "replicas",
        samples=1,
        harness={"name": "command", "command": twice},
        model={"provider": "openai", "base_url": urls, "affinity_header": "x-session-affinity"},
        concurrency={"workers": 1, "sessions_per_worker": 4},
    )
    try:
        with Executor(cfg) as ex:
            ex.submit([_task(f"r{i}", FAST) for i in range(4)])
            rows = [r for b in ex.batches(timeout_s=BOUND_S) for r in b.to_pylist()]
    finally:
        for server in servers:
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
    assert len(rows) == 4 and all(r["decision"] == "accept" for r in rows)
    per_session = [{c["replica"] for c in r["model_calls"]} for r in rows]
    assert all(
        len(r["model_calls"]) == 2 and len(seen) == 1 for r, seen in zip(rows, per_session, strict=True)
    )
    assert set().union(*per_session) == set(urls)  # spread over both, each session on one


def test_bad_input_is_one_line(tmp_path):
    from executor.tasks import InputError

    with pytest.raises(InputError, match="run_id is required"):
        Executor({"out": str(tmp_path)})
    ex = Executor(_config(tmp_path, "bad"), policy_version=3)
    with pytest.raises(InputError, match="must be greater than the current 3"):
        ex.update_policy(3)
    with pytest.raises(InputError, match="scripted model runs in each worker"):
        ex.update_policy(4, base_url="http://127.0.0.1:1/v1")
    with pytest.raises(InputError, match=r"task 0: .*prompt"):
        ex.submit([{"id": "x"}])
    with pytest.raises(InputError, match="form: 'arrow'"):
        Executor(_config(tmp_path, "bad"), form="arrow")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="no such task file"):
        ex.submit(tmp_path / "missing.jsonl")
