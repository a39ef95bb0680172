"""Hostile harness output: the row is still written with bounded evidence, and we stay in bounded memory.

Each payload runs twice through real parts: as a whole session with the `command` harness (its stdout is
its answer), and as the stdout Codex's adapter parses as its event stream, from a real local sandbox.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from executor.schema import rows_to_batch
from executor.session import SessionRequest, run_session
from executor.tasks import Task
from harnesses.codex import CodexHarness
from harnesses.command import CommandHarness
from sandboxes.base import SandboxSpec
from sandboxes.local import LocalSandboxProvider
from tests.conftest import processes_under, session_context

pytestmark = pytest.mark.integration

MB = 1024 * 1024
PAYLOADS = {
    "invalid_utf8": r"printf 'ok \377\376\200 \303\050 done\n'; printf '{\"type\": \"\377\"}\n'",
    "stdout_200mb": "head -c 200000000 /dev/zero | tr '\\0' 'a'",
    "one_mb_line": "head -c 1048576 /dev/zero | tr '\\0' 'x'; echo",
    "nested_json": "python3 -c \"print('{\\\"a\\\":' * 50000 + '1' + '}' * 50000)\"",
    "not_json": "printf 'this is not JSON\\n<html>\\n\\0\\0\\0\\n}{][\\n'",
}
# Everything a row keeps is bounded far below the payloads; evidence copies stop at their own limits.
ROW_TEXT_LIMIT = 70_000
# Codex's adapter reads at most 64 MB of event stream (bytes, then text): ~130 MB at its peak. Holding the
# 200 MB payload once, as bytes, or its text, would pass this.
RSS_GROWTH_LIMIT = 190 * MB


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


@pytest.mark.parametrize("name", sorted(PAYLOADS))
async def test_hostile_stdout_still_gives_a_bounded_row(tmp_path, name):
    _reset_peak()
    before = _rss()
    task = Task.model_validate({"id": f"hostile-{name}", "prompt": "misbehave", "verify": "true"})
    config = {"gateway": {"max_attempts_per_request": 1}, "limits": {"deadline_s": 60, "grace_s": 3}}
    async with session_context(tmp_path, config) as ctx:
        ctx.harness = CommandHarness(command=PAYLOADS[name])
        row = await run_session(SessionRequest("h", task, 0, 1), ctx)
    session_growth = _peak_rss() - before
    batch = rows_to_batch([row])  # the row is writable as it is
    assert batch.num_rows == 1
    assert row["status"] == "completed" and row["exit_code"] == 0, row["error_message"]
    for column in ("stdout_tail", "stderr_tail", "final_text", "error_message"):
        assert len(row[column] or "") <= ROW_TEXT_LIMIT, column
    evidence = Path(row["evidence_dir"])
    stdout = evidence / "harness.stdout.gz"
    assert stdout.exists()
    assert len(gzip.decompress(stdout.read_bytes())) <= 64 * MB  # the copy is bounded by its limit

    # The same bytes as Codex's event stream: its adapter must still return a report.
    provider = LocalSandboxProvider(tmp_path / "codex-sandboxes")
    sandbox = await provider.start(SandboxSpec(run_id="h", session_id=f"codex-{name}", ttl_s=120))
    try:
        result = await sandbox.exec(["sh", "-c", PAYLOADS[name]], timeout=60, name="harness")
        report = await CodexHarness().parse(sandbox, result)
    finally:
        await sandbox.stop()
    assert len(report.final_text or "") <= ROW_TEXT_LIMIT
    assert sum(len(m.text) for m in report.messages) <= 10 * ROW_TEXT_LIMIT
    assert "usage_unavailable" in report.evidence_gaps
    growth = _peak_rss() - before
    print(
        f"HOSTILE payload={name} stdout_bytes={result.stdout_bytes} "
        f"rss_growth_session_mb={session_growth / MB:.1f} rss_growth_with_codex_parse_mb={growth / MB:.1f}"
    )
    assert growth <= RSS_GROWTH_LIMIT
    assert not processes_under(str(tmp_path))
