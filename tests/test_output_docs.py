"""docs/output.md's snippet for reading a run's rows from S3 works against an S3 API that is not AWS
(moto's server here, as MinIO): pyarrow's S3FileSystem() alone does not read AWS_ENDPOINT_URL."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from executor.schema import rows_to_batch, with_decisions
from executor.session import SessionRequest, lost_row
from executor.storage import locate
from executor.store import RunStore
from executor.tasks import Task
from tests.conftest import REPO
from tests.s3_server import s3_server

pytestmark = pytest.mark.integration


def _snippet() -> str:
    page = (REPO / "docs" / "output.md").read_text()
    found = re.search(r"does not read `AWS_ENDPOINT_URL`.*?```python\n(.*?)```", page, re.DOTALL)
    assert found, "the S3 reading snippet is gone from docs/output.md"
    return found.group(1)


def test_the_documented_s3_read_finds_the_rows(tmp_path, monkeypatch):
    with s3_server(tmp_path / "moto.log") as s3:
        s3.client().create_bucket(Bucket="bucket")
        for key, value in s3.env().items():
            monkeypatch.setenv(key, value)
        store = RunStore(locate("s3://bucket/runs/demo"))
        task = Task(id="t0", prompt="p")
        rows = [lost_row(SessionRequest("demo", task, s, 1), "command", "local", "lost") for s in range(3)]
        store.append(with_decisions(rows_to_batch(rows), {"final": [False] * 3}))
        store.flush()
        code = _snippet().replace("BUCKET", "bucket") + "\nprint(rows.num_rows)\n"
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **s3.env()},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.split() == ["3"]
