"""Run storage on a real S3 API (moto's server on 127.0.0.1) against the local disk: rows appended per
second and the resume scan of N rows (``rollout bench`` part d, on each store), and what putting one
rollout's evidence costs (a launch directory as a session leaves it: 15 files, ~45 KB).

    PYTHONPATH=. .venv/bin/python tests/bench/bench_object_store.py [--rows 100000] [--uploads 50]

Prints the figures; asserts nothing. moto is a Python server: a real S3 is not slower.
"""

from __future__ import annotations

import argparse
import gzip
import os
import tempfile
import time
from pathlib import Path

from executor.storage import locate
from executor.testing.bench import store
from tests.s3_server import s3_server


def _launch_dir(root: Path) -> Path:
    (root / "model").mkdir(parents=True)
    for name in ("harness.stdout.gz", "harness.stderr.gz"):
        (root / name).write_bytes(gzip.compress(os.urandom(2000)))
    for i in range(6):
        (root / "model" / f"req-{i}.json.gz").write_bytes(os.urandom(3000))
        (root / "model" / f"resp-{i}-1.json.gz").write_bytes(os.urandom(3000))
    (root / "model" / "attempts.jsonl").write_bytes(b"x" * 4000)
    return root


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--uploads", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, s3_server(Path(scratch) / "moto.log") as s3:
        os.environ.update(s3.env())
        s3.client().create_bucket(Bucket="bench")
        for name, where in (("local disk", Path(scratch) / "local"), ("S3 (moto)", locate("s3://bench/d"))):
            d = store(args.rows, where)  # type: ignore[arg-type]  # a Location stands where a Path does
            print(
                f"{name:10}  {args.rows} rows: {d['append_rows_per_s']:,.0f} rows/s appended, "
                f"resume scan {d['resume_scan_s']:.2f} s"
            )
        source = _launch_dir(Path(scratch) / "launch")
        started = time.perf_counter()
        for i in range(args.uploads):
            locate(f"s3://bench/evidence/l{i}").upload_tree(source)
        per = (time.perf_counter() - started) / args.uploads
        print(f"evidence put per rollout (15 files, ~45 KB): {per * 1000:.0f} ms, in the worker's thread")


if __name__ == "__main__":
    main()
