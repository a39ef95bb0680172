"""Finding processes a sandbox left behind: the check that "no process is left" after a session."""

from __future__ import annotations

import os
from pathlib import Path


def processes_under(marker: str) -> list[str]:
    """Live processes whose command line or working directory mentions ``marker`` (a sandbox root)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = (
                Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            )
            cwd = os.readlink(f"/proc/{pid}/cwd")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if state != "Z" and (marker in cmdline or cwd.startswith(marker)):
            found.append(f"{pid}: {cmdline[:200]}")
    return found
