"""Run storage on a real S3 API (moto's server on 127.0.0.1): a run to ``s3://``, resumed, read back by
status, runs, report, export and replay; bad storage refused in one line before anything starts; part
files and the run lock never overwritten; a failed evidence upload an evidence gap, not a lost row."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from executor.reaper import evidence_scratch_root, new_evidence_scratch, reap_evidence_scratch
from executor.report import write_report
from executor.runs import list_runs
from executor.schema import rows_to_batch
from executor.session import SessionRequest, run_session
from executor.storage import locate
from executor.store import RunStore, part_files, read_table
from executor.tasks import Task
from harnesses.registry import make_harness
from tests.conftest import REPO, processes_under, sandbox_yaml, session_context
from tests.s3_server import S3Server, free_port, s3_server
from tests.test_store import _row

# The agent asks the model once through the gateway (so there are request/response bodies to keep),
# shows what of AWS_* it can see, and does the task.
AGENT = (
    'curl -s -o /dev/null "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer $OPENAI_API_KEY" '
    '-H "content-type: application/json" '
    '-d "{\\"model\\":\\"scripted-model\\",'
    '\\"messages\\":[{\\"role\\":\\"user\\",\\"content\\":\\"hi\\"}]}"; '
    'echo "aws vars: $(env | grep -c ^AWS_)"; touch done.txt; echo done'
)

# Takes a run's lock, says so, and holds it until killed.
HOLD = """
import sys
from executor.runs import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.fixture
def bucket(s3: S3Server) -> str:
    name = f"b-{secrets.token_hex(4)}"
    s3.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300"}


def _config(
    tmp_path: Path,
    out: str,
    tasks: int = 3,
    samples: int = 1,
    prompts: list[str] | None = None,
    agent: str = AGENT,
    gate: Path | None = None,
) -> Path:
    """A run of ``tasks`` tasks (prompted ``prompts``, else "p"), all in flight at once."""
    prompts = prompts or ["p"] * tasks
    lines = [
        json.dumps({"id": f"t{i}", "prompt": prompts[i], "verify": "test -f done.txt"}) for i in range(tasks)
    ]
    (tmp_path / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"tasks: tasks.jsonl\nout: {out}\nrun_id: r\nsamples: {samples}\n"
        f"sandbox: {sandbox_yaml(tmp_path / 'sandboxes', gate)}\n"
        f"harness: {{name: command, command: {json.dumps(agent)}}}\n"
        f"concurrency: {{workers: 1, sessions_per_worker: {tasks}}}\n"
    )
    return config


def _cli(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.integration
def test_a_run_on_s3_is_written_resumed_and_read_back_from_the_uri(tmp_path, s3, bucket, s3_env):
    uri = f"s3://{bucket}/runs"
    config = _config(tmp_path, uri)
    first = _cli(s3_env, "run", str(config), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]

    rows = read_table(f"{uri}/r").to_pylist()
    assert sorted(r["task_id"] for r in rows) == ["t0", "t1", "t2"]
    assert all(r["reward"] == 1.0 and r["final"] for r in rows)
    # Nothing of the credentials reached the sandbox, nor went into the run.
    assert all("aws vars: 0" in r["stdout_tail"] for r in rows), [r["stdout_tail"] for r in rows]
    keys = s3.keys(bucket)
    stored = b"".join(s3.client().get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys)
    assert b"testing" not in stored and s3.endpoint.encode() not in stored
    # Each row's evidence is where the row says, readable by anyone with the URI.
    for r in rows:
        assert r["evidence_dir"].startswith(f"{uri}/r/evidence/"), r["evidence_dir"]
        assert "evidence_upload_failed" not in " ".join(r["evidence_gaps"])
        prefix = r["evidence_dir"].removeprefix(f"s3://{bucket}/")
        names = {k.removeprefix(prefix + "/") for k in s3.keys(bucket, prefix)}
        assert {"harness.stdout.gz", "model/attempts.jsonl", "model/req-0.json.gz"} <= names, names
    assert not (tmp_path / "s3:").exists() and not (REPO / "s3:").exists()
    assert not list((evidence_scratch_root() / "r").glob("*/*/evidence-*")), "a worker's scratch was left"
    assert not processes_under(str(tmp_path / "sandboxes"))

    # A driver SIGKILLed while it held the run leaves its lock on S3: the next driver takes it over.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, f"{uri}/r"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=s3_env,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    holder.kill()
    holder.wait(timeout=30)
    assert "runs/r/driver.json" in s3.keys(bucket)

    # Resumed from the URI with a second sample each: only the new pairs run, and the parts written
    # before stay as they were.
    before = {p.name: p.read_bytes() for p in part_files(f"{uri}/r/rows")}
    again = _cli(s3_env, "run", str(config), "--samples", "2", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = read_table(f"{uri}/r").to_pylist()
    pairs = sorted((r["task_id"], r["sample_index"]) for r in rows if r["final"])
    assert pairs == sorted((f"t{i}", s) for i in range(3) for s in range(2))  # each exactly once
    assert {p.name: p.read_bytes() for p in part_files(f"{uri}/r/rows")}.items() >= before.items()
    assert "driver.json" not in " ".join(s3.keys(bucket))  # the lock went with its driver

    status = _cli(s3_env, "status", f"{uri}/r", "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr[-3000:]
    assert json.loads(status.stdout)["state"] == "complete" and json.loads(status.stdout)["final"] == 6
    # `rollout runs` and `rollout report` are these two calls on the URI (their CLIs: test_runs, test_report).
    assert [(r.run_id, r.state, r.final) for r in list_runs(uri)] == [("r", "complete", 6)]
    assert str(write_report(f"{uri}/r")) == f"{uri}/r/report.html"
    assert "runs/r/report.html" in s3.keys(bucket)
    export = _cli(s3_env, "export", f"{uri}/r", "--train", str(tmp_path / "train.parquet"), cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    trained = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(trained) == 6 and {t["prompt"] for t in trained} == {"p"}  # tasks from the run's snapshot
    replay = _cli(s3_env, "replay", f"{uri}/r", "t1.s0.a1", cwd=tmp_path)
    assert replay.returncode == 0 and "same outcome" in replay.stdout, replay.stdout + replay.stderr[-3000:]


@pytest.mark.integration
def test_a_driver_sigkilled_mid_run_on_s3_resumes_from_the_uri_with_each_pair_once(
    tmp_path, s3, bucket, s3_env, gate_dir
):
    """Three quick tasks finish and their part reaches S3 while three more wait in their agents on a gate;
    the driver is SIGKILLed there. The resume from the URI runs only what has no final row."""
    uri = f"s3://{bucket}/runs"
    gate = gate_dir / "open"
    wait = f'if [ "$ROLLOUT_PROMPT" = gated ]; then until [ -e {gate} ]; do sleep 0.1; done; fi; '
    prompts = ["quick"] * 3 + ["gated"] * 3
    config = _config(tmp_path, uri, tasks=6, prompts=prompts, agent=wait + AGENT, gate=gate)
    driver = subprocess.Popen(
        [sys.executable, "-m", "executor.cli", "run", str(config), "--no-preflight"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=s3_env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not part_files(f"{uri}/r/rows") and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # waiting for a condition, bounded; not synchronisation by sleeping
        assert driver.poll() is None, "the run ended before it could be killed"
        assert part_files(f"{uri}/r/rows"), "no part file on S3 within the bound"
    finally:
        driver.kill()
        driver.wait(timeout=60)
    before = read_table(f"{uri}/r").to_pylist()
    assert before and {r["task_id"] for r in before} <= {"t0", "t1", "t2"}
    deadline = time.monotonic() + 60
    while processes_under(str(tmp_path / "sandboxes")) and time.monotonic() < deadline:
        time.sleep(0.2)  # the killed driver's sandboxes end on their own, bounded
    assert not processes_under(str(tmp_path / "sandboxes"))

    gate.touch()
    again = _cli(s3_env, "run", str(config), "--no-preflight", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = read_table(f"{uri}/r").to_pylist()
    identities = [(r["task_id"], r["sample_index"], r["attempt"]) for r in rows]
    assert len(identities) == len(set(identities))
    finals = sorted((r["task_id"], r["sample_index"]) for r in rows if r["final"])
    assert finals == [(f"t{i}", 0) for i in range(6)]  # each pair exactly once
    assert all(r["reward"] == 1.0 for r in rows if r["final"])
    for r in rows:  # the evidence of rows written before and after the kill is on S3
        prefix = r["evidence_dir"].removeprefix(f"s3://{bucket}/")
        assert any(k.endswith("harness.stdout.gz") for k in s3.keys(bucket, prefix)), r["evidence_dir"]
    assert not processes_under(str(tmp_path / "sandboxes"))


@pytest.mark.parametrize("case", ["missing bucket", "endpoint not reached", "unsupported scheme"])
def test_bad_storage_is_one_line_and_exit_2_before_anything_starts(tmp_path, s3, s3_env, case):
    out = {
        "missing bucket": "s3://no-such-bucket/runs",
        "endpoint not reached": "s3://some-bucket/runs",
        "unsupported scheme": "hdfs://name/runs",
    }[case]
    env = dict(s3_env)
    if case == "endpoint not reached":
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = _cli(env, "run", str(_config(tmp_path, out)), "--no-preflight", cwd=tmp_path)
    line = _one_error_line(proc)
    assert out.split("/runs")[0] in line, line
    if case == "missing bucket":
        assert "bucket does not exist" in line, line
    if case == "endpoint not reached":
        assert "connect" in line.lower(), line
    assert not (tmp_path / "sandboxes").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml", "tasks.jsonl"]


def test_refused_credentials_are_one_line_and_exit_2_before_anything_starts(tmp_path, s3_env):
    with s3_server(tmp_path / "moto-auth.log", authenticating=True) as strict:
        env = {**s3_env, **strict.env()}
        config = _config(tmp_path, "s3://some-bucket/runs")
        proc = _cli(env, "run", str(config), "--no-preflight", cwd=tmp_path)
    line = _one_error_line(proc)
    assert "s3://some-bucket/runs" in line and "cannot write there" in line, line
    assert "INVALID_ACCESS_KEY_ID" in line, line
    assert "testing" not in line  # the key id is not echoed back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moto-auth.log", "run.yaml", "tasks.jsonl"]


def test_a_part_that_exists_on_s3_is_never_overwritten(s3, bucket, s3_env):
    run = f"s3://{bucket}/runs/p"
    store = RunStore(run)
    store.append(rows_to_batch([_row(task="a")]))
    store.flush()  # part-000000; this store's next number is now 1
    theirs = "runs/p/rows/part-000001.parquet"
    s3.client().put_object(Bucket=bucket, Key=theirs, Body=b"another writer's part")
    store.append(rows_to_batch([_row(task="b")]))
    store.flush()
    assert s3.client().get_object(Bucket=bucket, Key=theirs)["Body"].read() == b"another writer's part"
    assert [p.name for p in part_files(f"{run}/rows")][-1] == "part-000002.parquet"
    ours = locate(f"{run}/rows/part-000002.parquet")
    assert not ours.create(b"x")  # the conditional PUT is refused: the part stays whole
    assert ours.parquet().metadata.num_rows == 1


def test_a_live_driver_s_lock_on_s3_refuses_a_second_driver_with_one_line(tmp_path, s3, bucket, s3_env):
    from executor.runs import RunLockedError, run_lock

    uri = f"s3://{bucket}/runs"
    with run_lock(f"{uri}/r"):
        with pytest.raises(RunLockedError):
            with run_lock(f"{uri}/r"):
                pass
        proc = _cli(s3_env, "run", str(_config(tmp_path, uri)), "--no-preflight", cwd=tmp_path)
        assert "in use by another driver" in _one_error_line(proc)
    assert "driver.json" not in " ".join(s3.keys(bucket))  # released when the block ended


@pytest.mark.integration
async def test_a_failed_evidence_upload_is_a_gap_on_the_row_not_a_lost_row(tmp_path, monkeypatch):
    """The store is reached no more when the session ends (its endpoint stopped): the row comes back
    whole, says what is missing, and the worker's scratch copy is gone."""
    with s3_server(tmp_path / "moto.log") as gone:
        gone.client().create_bucket(Bucket="evidence")
        for key, value in gone.env().items():
            monkeypatch.setenv(key, value)
        store = locate("s3://evidence/runs/r/evidence")
    # stopped: every request to it is refused from here on
    harness = make_harness("command", None, AGENT)
    task = Task.model_validate({"id": "t0", "prompt": "p", "verify": "test -f done.txt"})
    async with session_context(tmp_path, harness=harness) as ctx:
        ctx.evidence_store = store
        row = await run_session(SessionRequest("r", task, 0, 1), ctx)
    assert row["status"] == "completed" and row["reward"] == 1.0, row["error_message"]
    gaps = [g for g in row["evidence_gaps"] if g.startswith("evidence_upload_failed: ")]
    assert len(gaps) == 1 and len(gaps[0]) < 300, row["evidence_gaps"]
    assert row["evidence_dir"].startswith("s3://evidence/runs/r/evidence/t0.s0.a1.")
    assert not (tmp_path / "evidence").exists(), "the scratch copy was left"


def test_a_uri_names_its_store_and_a_bad_one_is_one_line(tmp_path, s3_env):
    from executor.tasks import InputError

    assert locate(f"file://{tmp_path}/runs").local == tmp_path / "runs"
    assert locate(tmp_path / "runs").uri == str(tmp_path / "runs")
    remote = locate("s3://bkt/runs/")
    assert (remote.scheme, remote.path, (remote / "r").uri) == ("s3", "bkt/runs", "s3://bkt/runs/r")
    with pytest.raises(TypeError):
        os.fspath(remote)  # never taken for a local path by mistake
    for bad, said in (("s3://", "no bucket"), ("hdfs://n/runs", "hdfs:// storage is not supported")):
        with pytest.raises(InputError, match=said):
            locate(bad)
    once = locate(tmp_path / "x" / "part")
    assert once.create(b"first") and not once.create(b"second")
    assert once.read_bytes() == b"first"


# Makes evidence scratch for run "r" as a worker does, says where, and waits to be killed.
SCRATCH = """
import sys
from executor.reaper import new_evidence_scratch
scratch = new_evidence_scratch("r")
(scratch / "harness.stdout.gz").write_bytes(b"x")
print(scratch, flush=True)
sys.stdin.read()
"""


def test_the_evidence_scratch_of_a_sigkilled_worker_is_reaped_and_a_live_one_s_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this process's scratch root
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    worker = subprocess.Popen(
        [sys.executable, "-c", SCRATCH], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert worker.stdout is not None
    theirs = Path(worker.stdout.readline().strip())
    ours = new_evidence_scratch("r")
    assert theirs.parent.parent == ours.parent.parent == evidence_scratch_root() / "r" / "scratch"
    assert reap_evidence_scratch() == []  # its owner lives
    worker.kill()
    worker.wait(timeout=30)
    assert reap_evidence_scratch() == [str(theirs.parent.relative_to(evidence_scratch_root()))]
    assert not theirs.exists() and ours.is_dir()
