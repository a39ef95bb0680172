import os
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from executor.row import SCHEMA_VERSION
from executor.schema import (
    COLUMNS,
    ROW_SCHEMA,
    batch_from_wire,
    batch_to_wire,
    rows_to_batch,
    with_decisions,
)
from executor.store import RunStore, part_files, read_table, scan


def _row(task="t", sample=0, attempt=1, decision="accept", final=True, **extra):
    return {
        "run_id": "r",
        "rollout_id": f"{task}.s{sample}.a{attempt}",
        "task_id": task,
        "sample_index": sample,
        "attempt": attempt,
        "status": "completed",
        "failure_kind": "none",
        "decision": decision,
        "final": final,
        **extra,
    }


def test_schema_columns_cover_identity_and_decision():
    for name in (
        "run_id",
        "rollout_id",
        "task_id",
        "sample_index",
        "attempt",
        "status",
        "failure_kind",
        "reward",
        "decision",
        "masked",
        "final",
        "tool_calls",
        "model_calls",
        "evidence_gaps",
        "verifier_runs",
    ):
        assert name in COLUMNS
    assert ROW_SCHEMA.metadata[b"rollout_executor_schema"] == SCHEMA_VERSION.encode()


def test_rows_travel_from_worker_to_driver_unchanged():
    batch = rows_to_batch([_row(task="a", reward=1.0, evidence_gaps=["x"]), _row(task="b", final_text="é\0")])
    back = batch_from_wire(batch_to_wire(batch))
    assert back.equals(batch) and back.schema.metadata == ROW_SCHEMA.metadata


def test_rows_of_another_schema_version_are_refused_by_name():
    import pyarrow as pa

    old = pa.schema([pa.field("run_id", pa.string())], metadata={"rollout_executor_schema": "1"})
    sent = batch_to_wire(pa.RecordBatch.from_pylist([{"run_id": "r"}], schema=old))
    with pytest.raises(ValueError, match=f"schema version 1, this driver writes version {SCHEMA_VERSION}"):
        batch_from_wire(sent)


def test_warm_up_leaves_the_first_row_nothing_to_import():
    """pyarrow imports pandas (installed with the test extra) at its first conversion; a worker or a
    driver that warmed up pays that before its first session, not in the middle of its run."""
    script = textwrap.dedent(
        """
        import datetime, sys
        from executor.schema import batch_from_wire, batch_to_wire, rows_to_batch, warm_up
        warm_up()
        before = set(sys.modules)
        row = {"run_id": "r", "rollout_id": "t.s0.a1", "task_id": "t", "sample_index": 0, "attempt": 1,
               "status": "completed", "failure_kind": "none", "reward": 1.0, "t_total_s": 0.5,
               "started_at": datetime.datetime.now(datetime.timezone.utc),
               "model_calls": [{"request_index": 0, "status": 200, "latency_s": 0.1}]}
        batch_from_wire(batch_to_wire(rows_to_batch([row]))).to_pylist()
        print(sorted(set(sys.modules) - before))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_unknown_column_rejected():
    with pytest.raises(ValueError, match="outside the schema"):
        rows_to_batch([_row(colour="red")])


def test_nested_columns_round_trip(tmp_path):
    row = _row(
        tool_calls=[{"name": "shell", "status": "failed", "exit_code": 7}],
        messages=[{"role": "assistant", "text": "hi"}],
        evidence_gaps=["usage_unavailable"],
        input_tokens=None,
        reward=1.0,
    )
    store = RunStore(tmp_path / "run")
    store.append(rows_to_batch([row]))
    store.flush()
    back = read_table(tmp_path / "run").to_pylist()[0]
    assert back["tool_calls"][0]["exit_code"] == 7
    assert back["input_tokens"] is None  # unknown stays unknown, not 0
    assert back["evidence_gaps"] == ["usage_unavailable"]


def test_with_decisions_replaces_only_decision_columns():
    batch = rows_to_batch([_row(decision=None, final=None, reward=1.0)])
    out = with_decisions(batch, {"decision": ["mask"], "final": [True], "masked": [True], "reward": [None]})
    row = out.to_pylist()[0]
    assert (row["decision"], row["final"], row["masked"], row["reward"]) == ("mask", True, True, None)
    assert row["task_id"] == "t"


def test_parts_are_whole_and_numbered(tmp_path):
    store = RunStore(tmp_path / "run", flush_rows=2)
    for i in range(5):
        store.append(rows_to_batch([_row(task=f"t{i}")]))
    store.flush()
    parts = part_files(tmp_path / "run" / "rows")
    assert [p.name for p in parts] == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert sum(pq.ParquetFile(p).metadata.num_rows for p in parts) == 5
    # a new store continues the numbering instead of overwriting
    again = RunStore(tmp_path / "run")
    again.append(rows_to_batch([_row(task="t9")]))
    again.flush()
    assert part_files(tmp_path / "run" / "rows")[-1].name == "part-000003.parquet"


def test_resume_state(tmp_path):
    store = RunStore(tmp_path / "run")
    store.append(
        rows_to_batch(
            [
                _row("a", 0, 1, "retry", False),
                _row("a", 0, 2, "mask", True),
                _row("b", 0, 1, "retry", False),
                _row("c", 1, 1, "accept", True),
            ]
        )
    )
    store.flush()
    state = scan(tmp_path / "run" / "rows")
    assert state.final == {("a", 0), ("c", 1)}
    assert state.last_attempt[("b", 0)] == 1
    assert state.retries_used == 2


def test_stale_tmp_ignored_then_removed_at_the_first_write(tmp_path):
    rows = tmp_path / "run" / "rows"
    rows.mkdir(parents=True)
    (rows / "part-000000.parquet.tmp").write_bytes(b"torn")
    (rows / ".part.123.abc.tmp").write_bytes(b"torn")
    store = RunStore(tmp_path / "run")
    assert store.resume_state().rows == 0
    # Making a store removes nothing: a driver refused the run's lock must not touch the holder's files.
    assert len(list(rows.glob("*.tmp"))) == 2
    store.append(rows_to_batch([_row()]))
    store.flush()  # only the lock's holder flushes: every temporary left is a dead writer's
    assert not list(rows.glob("*.tmp"))
    assert [p.name for p in rows.iterdir()] == ["part-000000.parquet"]


def test_a_store_that_never_wrote_made_nothing(tmp_path):
    store = RunStore(tmp_path / "run")
    assert store.resume_state().rows == 0 and read_table(tmp_path / "run").num_rows == 0
    store.flush()
    assert not (tmp_path / "run").exists()


def test_a_part_name_that_exists_is_never_overwritten(tmp_path):
    """A part name taken after this store chose its number (another writer, which the run lock should
    have kept out) is left as it is; the rows go to the next free number."""
    first = RunStore(tmp_path / "run")
    first.append(rows_to_batch([_row(task="a")]))
    first.flush()  # part-000000; this store's next number is now 1
    rows = tmp_path / "run" / "rows"
    theirs = [rows / "part-000001.parquet", rows / "part-000002.parquet"]
    for path, task in zip(theirs, ("x", "y"), strict=True):
        pq.write_table(read_table(tmp_path / "run").slice(0, 1).set_column(2, "task_id", [[task]]), path)
    before = [p.read_bytes() for p in theirs]
    first.append(rows_to_batch([_row(task="b")]))
    first.flush()
    assert [p.read_bytes() for p in theirs] == before
    assert [p.name for p in part_files(rows)][-1] == "part-000003.parquet"
    assert sorted(read_table(tmp_path / "run", ["task_id"]).column("task_id").to_pylist()) == [
        "a",
        "b",
        "x",
        "y",
    ]
    assert not list(rows.glob("*.tmp"))


def test_a_writer_gives_up_rather_than_overwrite_when_every_name_is_taken(tmp_path):
    from executor.store import PART_NAME_TRIES, StoreError

    store = RunStore(tmp_path / "run")
    store.append(rows_to_batch([_row(task="a")]))
    store.flush()
    rows = tmp_path / "run" / "rows"
    for n in range(1, 1 + PART_NAME_TRIES):
        (rows / f"part-{n:06d}.parquet").write_bytes(b"someone else's")
    store.append(rows_to_batch([_row(task="b")]))
    with pytest.raises(StoreError, match="all exist"):
        store.flush()
    assert all(
        (rows / f"part-{n:06d}.parquet").read_bytes() == b"someone else's"
        for n in range(1, 1 + PART_NAME_TRIES)
    )
    assert not list(rows.glob("*.tmp"))


def test_a_part_file_of_the_previous_schema_reads_verifier_runs_as_null(tmp_path):
    store = RunStore(tmp_path / "run")
    store.append(rows_to_batch([_row(task="new", verifier_runs=2)]))
    store.flush()
    older = read_table(tmp_path / "run").drop_columns(["verifier_runs"])
    pq.write_table(
        older.set_column(2, "task_id", [["old"]]), tmp_path / "run" / "rows" / "part-000001.parquet"
    )
    table = read_table(tmp_path / "run")
    assert table.schema.names == list(COLUMNS)
    assert dict(
        zip(table.column("task_id").to_pylist(), table.column("verifier_runs").to_pylist(), strict=True)
    ) == {
        "new": 2,
        "old": None,
    }
    chosen = read_table(tmp_path / "run", ["verifier_runs", "task_id"])
    assert chosen.schema.names == ["verifier_runs", "task_id"] and chosen.num_rows == 2


def test_a_part_file_of_version_3_reads_its_model_attempts_as_model_calls(tmp_path):
    call = {"request_index": 0, "status": 429, "kind": "rate_limit_exceeded", "retry_after_s": 2.0}
    store = RunStore(tmp_path / "run")
    store.append(rows_to_batch([_row(task="new", model_calls=[call])]))
    store.flush()
    new = read_table(tmp_path / "run")
    names = ["model_attempts" if n == "model_calls" else n for n in new.schema.names]
    older = new.rename_columns(names).replace_schema_metadata({"rollout_executor_schema": "3"})
    pq.write_table(
        older.set_column(2, "task_id", [["old"]]), tmp_path / "run" / "rows" / "part-000001.parquet"
    )
    table = read_table(tmp_path / "run")
    assert table.schema.names == list(COLUMNS) and "model_attempts" not in table.schema.names
    calls = dict(
        zip(table.column("task_id").to_pylist(), table.column("model_calls").to_pylist(), strict=True)
    )
    assert calls["old"] == calls["new"] and calls["old"][0]["status"] == 429
    chosen = read_table(tmp_path / "run", ["task_id", "model_calls"])
    assert chosen.column("model_calls").to_pylist() == [calls["new"], calls["old"]]


def test_sigkill_mid_write_leaves_no_torn_part(tmp_path):
    # A writer process appends and flushes in a loop; we kill it and every part file must read whole.
    script = textwrap.dedent(f"""
        import os, random, signal, sys, threading
        sys.path.insert(0, {os.getcwd()!r})
        from executor.schema import rows_to_batch
        from executor.store import RunStore
        store = RunStore(__import__("pathlib").Path({str(tmp_path / "run")!r}), flush_rows=50)
        i = 0
        while True:
            store.append(rows_to_batch([{{"run_id": "r", "rollout_id": str(i), "task_id": str(i),
                                          "sample_index": 0, "attempt": 1}}] * 25))
            i += 1
            if i == 2:
                # Armed once the first part is written, so a slow machine cannot kill before any write;
                # the kill lands at a random moment, usually in the middle of writing a later part file.
                threading.Timer(random.uniform(0.05, 0.5), os.kill, (os.getpid(), signal.SIGKILL)).start()
    """)
    proc = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == -9
    parts = part_files(tmp_path / "run" / "rows")
    assert parts
    total = sum(pq.read_table(p).num_rows for p in parts)
    assert total > 0 and total % 50 == 0
