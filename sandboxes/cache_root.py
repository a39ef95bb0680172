"""Where installs, the warm executor's files and other caches of ours live: light to import, as the
``rollout`` command reads it before it imports anything else."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_root() -> Path:
    """``$ROLLOUT_CACHE``, else ``~/.cache/rollout-executor``."""
    configured = os.environ.get("ROLLOUT_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "rollout-executor"
