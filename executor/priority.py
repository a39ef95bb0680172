"""The CPU priority of a worker actor's process.

Ray starts every worker process at nice 15 (its ``worker_niceness``), so that compute-bound tasks leave
the raylet and the GCS room. A rollout worker is the opposite: it spends its time waiting on sandboxes and
the model, and each of its steps (a sandbox's start, the diff and the verifier, the row) is on a session's
path. At nice 15 each of them waits behind any busy process at the normal priority that shares its CPU
scheduling group (a container's or a pod's cgroup, a session under autogroup scheduling): with two
CPU-bound processes on 2 cores, a rollout's own steps took 0.45 s instead of 0.07 s beside a harness
that ran at the normal priority (`rollout bench --parts a`, docs/performance.md). So the worker takes
the normal priority back, for every thread it has (a Linux nice value is per thread; threads made later
inherit their maker's), where it is allowed to (root, CAP_SYS_NICE, or an RLIMIT_NICE that allows it).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
NORMAL = 0


def take_normal_priority() -> None:
    """Give every thread of this process that runs below the normal CPU priority the normal one. A process
    that is not allowed to raise its priority keeps it, with a log line."""
    try:
        tids = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: not Linux, where this matters
        return
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) <= NORMAL:
                continue
            os.setpriority(os.PRIO_PROCESS, tid, NORMAL)
        except PermissionError:
            log.info("worker: cannot take the normal CPU priority back from Ray's worker niceness")
            return
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
