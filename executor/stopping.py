"""An orderly stop on SIGTERM and SIGINT (`kill`, `ray job stop`, Ctrl-C), instead of Ray's abort.

``ray.init`` sets a SIGTERM handler in the driver (``sys.exit``), and the core worker it starts then puts
its own C++ failure handler in place of it, which prints a stack and kills the process: no summary, the
sessions' sandboxes and the run's own cluster left to fate. So ``take`` is called right after Ray is
connected (``executor.driver.connect_ray``), from the main thread, and takes both signals back: the
first one only asks the run to stop, and the driver's loop sees ``requested()`` within a turn; it then
writes the sessions in flight as ``cancelled`` rows, the summary, stops their sandboxes and the cluster it
started. A second signal ends the process as the signal would have, for a user who will not wait.

``release`` gives the handlers back to what they were before ``take`` (a trainer's own, or Ray's).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_requested: int | None = None
_previous: dict[int, Any] = {}


def _handle(signum: int, _frame: FrameType | None) -> None:
    global _requested
    if _requested is None:
        _requested = signum
        return
    # A second one: as if we had never taken it.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def take() -> None:
    """Stop at SIGTERM and SIGINT in order from now on; idempotent, and called again after each
    ``ray.init`` (which sets its own). Only the main thread can set handlers: elsewhere it does nothing
    (a driver run in a thread, as tests do, is stopped by its caller). A signal this process ignores
    (``nohup``, a background job's SIGINT) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        current = signal.getsignal(sig)
        if current is signal.SIG_IGN:
            continue
        if sig not in _previous:
            _previous[sig] = current
        signal.signal(sig, _handle)


def release() -> None:
    """Give the handlers ``take`` replaced back, and forget a request (the next run starts afresh)."""
    global _requested
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, previous in list(_previous.items()):
        try:
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        except (TypeError, ValueError) as exc:  # a handler set from C that Python cannot name
            log.debug("signal %s left to ours: %s", sig, exc)
            continue
        del _previous[sig]
    _requested = None


def requested() -> int | None:
    """The signal that asked the run to stop, if one did."""
    return _requested


def exit_code(signum: int) -> int:
    """What a run stopped by ``signum`` exits with, as a shell reports a command it killed: 130 for
    SIGINT, 143 for SIGTERM. Everything was written and stopped first."""
    return 128 + signum
