"""`rollout model serve` as a user starts it: its own process, a port of its own, stopped at the end."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.ports import free_port

REPO = Path(__file__).parents[1]
LISTEN_BOUND_S = 60


@contextlib.contextmanager
def served_model(script: Path) -> Iterator[str]:
    """The scripted model's CLI serving ``script``; yields its base URL (``.../v1``)."""
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "executor.cli",
            "model",
            "serve",
            "--port",
            str(port),
            "--script",
            str(script),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + LISTEN_BOUND_S
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)  # waiting for the server to listen, bounded
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
