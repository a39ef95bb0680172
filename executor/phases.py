"""When a run's fixed costs fall: monotonic marks the CLI and the driver take as a run goes.

The marks are taken on this host's monotonic clock, which every process on the host shares, so
`rollout bench` can put them beside the moment it spawned the command and the moment the command
exited. They go into summary.json as ``phases`` (seconds after the first mark) and to the debug log.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

_marks: dict[str, float] = {}


def mark(name: str, at: float | None = None) -> None:
    """Note that ``name`` happened now (or at ``at``, a monotonic time); the first mark of a name wins,
    so a phase that recurs (a resumed loop) keeps its first time."""
    when = time.monotonic() if at is None else at
    _marks.setdefault(name, when)
    log.debug("phase %s at %.3f s", name, when - min(_marks.values()))


def report() -> dict[str, float]:
    """The marks so far as seconds after the first, plus ``origin_monotonic``: the first mark's time."""
    if not _marks:
        return {}
    origin = min(_marks.values())
    out = {name: round(at - origin, 4) for name, at in sorted(_marks.items(), key=lambda kv: kv[1])}
    return {"origin_monotonic": origin, **out}


def reset() -> None:
    """Forget the marks: a process that runs several drivers (a benchmark, a test) times each alone."""
    _marks.clear()
