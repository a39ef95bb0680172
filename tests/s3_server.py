"""A real S3 API on 127.0.0.1: moto's standalone server (``moto[server]``) in a process of its own, started
on a free port and stopped by its pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.ports import free_port

MOTO = Path(sys.executable).parent / "moto_server"
START_BOUND_S = 60.0


@dataclass
class S3Server:
    proc: subprocess.Popen[bytes]
    endpoint: str

    def env(self) -> dict[str, str]:
        """The standard variables that point the AWS SDK (pyarrow's and boto3's) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@contextmanager
def s3_server(log: Path, authenticating: bool = False) -> Iterator[S3Server]:
    """``authenticating``: the server checks every request's credentials against its own (empty) IAM, as
    AWS does, so any key is refused; by default moto accepts any key."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if authenticating:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(MOTO), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    server = S3Server(proc, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + START_BOUND_S
        while not _listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"moto_server did not listen (exit {proc.poll()}): {log.read_text()[-2000:]}"
                )
            time.sleep(0.1)  # waiting for a condition, bounded; not synchronisation by sleeping
        yield server
    finally:
        server.stop()
