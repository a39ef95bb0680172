"""Finding processes a sandbox left behind: the check that "no process is left" after a session."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from sandboxes import proctree

# How long a process whose command line reads empty is watched: that is one in the middle of an exec,
# or of an exit (its memory gone, its working directory not yet), which ends as a zombie in moments.
SETTLE_S = 10.0
SETTLE_POLL_S = 0.01


def _read(pid: str) -> tuple[str, str, str]:
    """The command line, working directory and state of ``pid``; raises OSError once it is gone."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    cwd = os.readlink(f"/proc/{pid}/cwd")
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return cmdline, cwd, state


def _settled(pid: str, marker: str, cmdline: str, cwd: str, state: str) -> tuple[str, str, str]:
    """What ``pid`` shows once its command line reads again or it is a zombie, within ``SETTLE_S``; only
    for one in ``marker`` by its working directory (a kernel thread's command line is empty for good)."""
    deadline = time.monotonic() + SETTLE_S
    while not cmdline and cwd.startswith(marker) and state != "Z" and time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_S)  # polling a process through its exec or exit, bounded
        cmdline, cwd, state = _read(pid)
    return cmdline, cwd, state


def processes_under(marker: str) -> list[str]:
    """Live processes whose command line or working directory mentions ``marker`` (a sandbox root). One in
    the middle of its exit is not counted, nor one in the middle of an exec missed."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline, cwd, state = _settled(pid, marker, *_read(pid))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if state != "Z" and (marker in cmdline or cwd.startswith(marker)):
            found.append(f"{pid}: {cmdline[:200]}")
    return found


def ended(pid: int, bound_s: float) -> bool:
    """Whether process ``pid`` (not necessarily our child) has ended within ``bound_s``: waited for by its
    pidfd, readable once it has ended, so after its files are closed and it has left its cgroup."""
    return proctree.ended_within(pid, bound_s)


def signal_state(pid: int) -> str:
    """A process's state and signal masks as /proc shows them (blocked, ignored, caught), for a test
    that sent it a signal it did not act on."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as exc:
        return f"pid {pid}: {exc}"
    wanted = ("State:", "SigPnd:", "ShdPnd:", "SigBlk:", "SigIgn:", "SigCgt:")
    return f"pid {pid}: " + "; ".join(line for line in lines if line.startswith(wanted))


def stopped_by(proc: Any, signum: int, bound_s: float) -> int:
    """Send ``signum`` to ``proc`` (a Popen) and wait for its exit code within ``bound_s``; past it,
    fail with the process's signal masks (then kill it: it must not outlive the test)."""
    if proc.poll() is None:
        proc.send_signal(signum)
    try:
        return int(proc.wait(timeout=bound_s))
    except subprocess.TimeoutExpired:
        state = signal_state(proc.pid)
        proc.kill()
        proc.wait(timeout=60)
        raise AssertionError(
            f"signal {signum} did not end the process within {bound_s:.0f} s: {state}"
        ) from None
