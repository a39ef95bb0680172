"""The in-sandbox agent as a real local process, for tests that need a remote sandbox without a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sandboxes.remote import AGENT_PATH


@dataclass
class AgentProcess:
    proc: subprocess.Popen[bytes]
    root: Path
    token: str
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_agent(
    root: Path,
    token: str,
    *extra: str,
    wait_s: float = 20.0,
    agent: Path = AGENT_PATH,
    python_flags: Sequence[str] = (),
    user: tuple[int, int] | None = None,
    python: str = sys.executable,
) -> AgentProcess:
    """Start the agent with ``token`` in a 0600 file; return once its rendezvous file says it listens.
    ``agent`` and ``python_flags``: which copy of agent.py, under which interpreter options. ``user``
    (uid, gid; we are root): the agent runs as that user, as a Slurm job of a worker that is not root,
    under ``python`` (which that user must be able to run)."""
    root.mkdir(parents=True, exist_ok=True)
    control = root.parent / f"{root.name}.control"
    control.mkdir(exist_ok=True)
    token_file = control / "token"
    token_file.write_text(token)
    os.chmod(token_file, 0o600)
    ready = control / "ready.json"
    argv = [python, *python_flags, str(agent), "--root", str(root), "--token-file", str(token_file)]
    if user is not None:
        for path in (root, control, token_file):
            os.chown(path, *user)
        argv = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", *argv]
    proc = subprocess.Popen([*argv, "--rendezvous", str(ready), *extra], stderr=subprocess.PIPE)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if ready.exists():
            info = json.loads(ready.read_text())
            return AgentProcess(proc, root, token, info["host"], int(info["port"]))
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError("agent not ready in time")
