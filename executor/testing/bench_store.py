"""`rollout bench` (d): the Arrow store's append rate and resume scan (see executor/testing/bench.py)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any


def store(rows: int, scratch: Path, where: str | None = None) -> dict[str, Any]:
    """``where``: a URI (an object store's, e.g.) to write the rows under, in a directory of its own that
    is removed after; by default the local scratch directory."""
    from executor.row import Message, Row, ToolCall
    from executor.schema import rows_to_batch
    from executor.store import RunStore, scan

    def row(i: int) -> dict[str, Any]:
        return Row(
            run_id="d",
            rollout_id=f"t{i}.s0.a1",
            task_id=f"t{i}",
            sample_index=0,
            attempt=1,
            status="completed",
            failure_kind="none",
            decision="accept",
            final=True,
            masked=False,
            reward=1.0,
            final_text="done " * 40,
            tool_calls=[ToolCall(name="shell", status="completed", exit_code=0, output="ok\n")],
            messages=[Message(role="assistant", text="x" * 400)],
        ).to_dict()

    batches = [
        rows_to_batch([row(i) for i in range(start, min(start + 100, rows))]) for start in range(0, rows, 100)
    ]
    from executor.storage import locate

    base = locate(where) / f"bench-d-{uuid.uuid4().hex[:8]}" if where else locate(scratch)
    st = RunStore(base / "d", flush_rows=10_000)
    try:
        t0 = time.perf_counter()
        for batch in batches:
            st.append(batch)
        st.flush()
        append_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        state = scan(base / "d" / "rows")
        scan_s = time.perf_counter() - t0
    finally:
        if where:
            base.fs.delete_dir(base.path)
    assert len(state.final) == rows
    return {
        "rows": rows,
        "store": base.uri if where else "local disk",
        "append_rows_per_s": rows / append_s,
        "resume_scan_s": scan_s,
    }
