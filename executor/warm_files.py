"""The warm executor's files (executor/warm.py holds what they mean), found without importing anything
heavy: the ``rollout`` command looks for the pre-imported driver's socket before its own imports."""

from __future__ import annotations

import os
from pathlib import Path

from sandboxes.cache_root import default_cache_root

RECORD = "executor.json"
DAEMON_LOCK = "daemon.lock"
LEASE_LOCK = "lease.lock"
LOG = "daemon.log"
SOCKET = "driver.sock"  # the pre-imported driver's (executor/driver_server.py)


def warm_dir() -> Path:
    """``$ROLLOUT_WARM_DIR``, else ``warm/`` in the cache root."""
    configured = os.environ.get("ROLLOUT_WARM_DIR")
    if configured:
        return Path(configured).expanduser()
    return default_cache_root() / "warm"
