"""`rollout bench --parts f`: many sessions in flight at once on this machine.

A null harness that sleeps (``sleep S``) in local sandboxes, ``workers x sessions_per_worker`` of them at
once, so every session waits the same ``S`` seconds and whatever the run takes beyond ``S`` per wave is
the executor's. While it runs, a sampler reads /proc every ``SAMPLE_S``: the processes under the run's
sandbox root (supervisor servers, supervisors, the harness commands), the worker actors' and the
driver's memory and file descriptors, and the machine's CPU time.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import resource
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from executor.testing.bench_raylets import raylets
from sandboxes.testing.leaks import processes_under

SAMPLE_S = 1.0  # between samples, at least
# ... and at most this share of one core: one look at 6,000 processes (/proc of each, smaps_rollup of the
# sandboxes') took ~0.3 s of CPU, and a sampler looking every second took 114 s of a 340 s run's 2 cores,
# its niceness no help against the run's processes in other sessions (the kernel's autogroups): the
# bursts it measures ran that much slower. The waits grow with the run instead (~15 s at 1,000 sessions).
SAMPLER_SHARE = 0.02
# The sandbox processes' PSS (smaps_rollup of thousands of processes, the sampler's dearest read) is read
# every this many samples, and whenever their count is at a new peak; never while it is still rising (a
# burst of starts, whose cores the read would take: the peak comes once they are all up). Their count
# every sample.
PSS_EVERY = 5
_TICK = os.sysconf("SC_CLK_TCK")
WORKER_TITLE = b"ray::SandboxWorker"
# A worker's fork server and the supervisor servers started without one: every sandbox process descends
# from one of these, which the sampler moves into the run's "sandboxes" CPU group as soon as it sees it.
ZYGOTE_TITLE = b"zygote.py"
SANDBOX_ROOTS = (ZYGOTE_TITLE, b"supervisor_server.py")
MOVE_S = 0.1  # how often the mover looks for new workers and fork servers


def _machine_cpu_s() -> float:
    """CPU seconds spent by the whole machine since boot, idle and iowait excluded."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    values = [int(v) for v in fields]
    busy = sum(values) - values[3] - values[4]  # idle, iowait
    return busy / _TICK


def _pages_allocated() -> int:
    """Pages the machine's kernel has handed out since boot (/proc/vmstat's pgalloc_*, every zone)."""
    return sum(
        int(value)
        for name, value in (line.split() for line in Path("/proc/vmstat").read_text().splitlines())
        if name.startswith("pgalloc_")
    )


def _stat_fields(pids: Iterable[int] | None = None) -> Iterator[tuple[int, list[bytes]]]:
    """Each process's /proc stat fields after its command name (state first, its parent second), for
    every process of ``pids`` (default: the machine's) that is there to read."""
    if pids is None:
        pids = (int(name) for name in os.listdir("/proc") if name.isdigit())
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            yield pid, Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()


def _kernel_threads() -> dict[tuple[int, int], int]:
    """The CPU ticks each of the kernel's threads has spent so far, by (pid, start time): kworkers come and
    go, and where the machine runs one, its kdamond (a DAMON monitor) costs more with every process that
    maps a shared page, so a thousand sandboxes' interpreters make it a visible part of the machine's CPU."""
    return {
        (pid, int(fields[19])): int(fields[11]) + int(fields[12])
        for pid, fields in _stat_fields()
        if pid == 2 or fields[1] == b"2"  # kthreadd, and what it started
    }


def _kernel_threads_cpu_s(before: dict[tuple[int, int], int]) -> float:
    """What the kernel's threads alive now spent since ``before`` (a thread that ended meanwhile is lost)."""
    return sum(t - before.get(key, 0) for key, t in _kernel_threads().items()) / _TICK


class Sampler:
    """Peaks of what a run holds, read from /proc on a thread of its own until ``stop``."""

    def __init__(self, sandbox_root: Path, cpu: TreeCpu | None = None, expected_workers: int = 0) -> None:
        self.marker = str(sandbox_root).encode()
        self.expected_workers = expected_workers
        self._thread_cpu = 0.0
        self._mover_cpu = 0.0
        self.peak: dict[str, float] = {}
        self._cpu = cpu
        self._samples = 0
        self._sandboxes_seen = 0  # the sandbox processes at the last sample
        self._pss_at = 0  # ... and at the last read of their PSS
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)

        self._mover = threading.Thread(target=self._move_loop, name="bench-mover", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        if self._cpu is not None and self._cpu.group is not None:
            self._mover.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self._mover.is_alive():
            self._mover.join(timeout=30)

    def _move_loop(self) -> None:
        """Puts each worker actor of ours into the run's "workers" CPU group and each one's fork server
        into its "sandboxes" group as soon as they appear (what they fork after that is born there), so
        that the run's CPU splits by part exactly. Ends once every worker's fork server is moved: a server
        a worker started without one (before its fork server was up) is moved too, but does not count,
        or the loop could end before the fork servers, and everything they fork, were moved."""
        assert self._cpu is not None
        if self._cpu.group is None:
            return  # nothing to move them into
        self._cpu.exclude_this_thread()
        workers: set[int] = set()
        roots: set[int] = set()
        zygotes: set[int] = set()
        while not self._stop.wait(MOVE_S) and len(zygotes) < self.expected_workers:
            # Tens of processes (the cluster's, the workers, a fork server just started), where the
            # machine's are thousands while the sandboxes start: a look at all of them every MOVE_S took
            # seconds of the CPU the sandboxes' starts wait for.
            parent = self._cpu.unmoved()
            titles: dict[int, bytes] = {}
            for pid in _descendants({os.getpid()}, parent) - workers - roots:
                with contextlib.suppress(OSError):
                    titles[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()[:300]
            # A worker's child has its title too until it execs (its fork server, just forked): a
            # worker is one whose parent is no worker.
            titled = {pid for pid, title in titles.items() if title.startswith(WORKER_TITLE)}
            for pid, title in titles.items():
                if pid in titled and parent.get(pid) not in titled | workers:
                    if self._cpu.move(pid, "workers"):
                        workers.add(pid)
                elif parent.get(pid) in workers and any(root in title for root in SANDBOX_ROOTS):
                    if self._cpu.move(pid, "sandboxes"):
                        roots.add(pid)
                        if ZYGOTE_TITLE in title:
                            zygotes.add(pid)
                        # What it forked before we saw it (a spare server, and what that forked).
                        for child in _descendants({pid}, parent) - {pid}:
                            self._cpu.move(child, "sandboxes")
            self._mover_cpu = time.thread_time()

    def thread_cpu_s(self) -> float:
        """The CPU of the sampler's and the mover's threads: this process's, and no part of the run."""
        return self._thread_cpu + self._mover_cpu

    def _note(self, name: str, value: float) -> None:
        self.peak[name] = max(self.peak.get(name, 0), value)

    def _loop(self) -> None:
        # The measuring is not the run's: this thread leaves the run's CPU account, takes the lowest
        # priority, and at most SAMPLER_SHARE of a core.
        if self._cpu is not None:
            self._cpu.exclude_this_thread()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        wait = SAMPLE_S
        while not self._stop.wait(wait):
            began = time.thread_time()
            self.sample()
            self._thread_cpu = time.thread_time()
            wait = max(SAMPLE_S, (self._thread_cpu - began) / SAMPLER_SHARE)

    def sample(self) -> None:
        """One look at every process: this process's descendants are the cluster it started (GCS,
        raylet, worker actors); a process working under the sandbox root is a sandbox's, wherever it
        hangs in the tree (a sandbox's supervisor server leaves the worker's process group)."""
        parent: dict[int, int] = {}
        title: dict[int, bytes] = {}
        in_sandbox: set[int] = set()
        for pid, fields in _stat_fields():
            parent[pid] = int(fields[1])
            try:
                title[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()[:64]
                if os.readlink(f"/proc/{pid}/cwd").encode().startswith(self.marker):
                    in_sandbox.add(pid)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        ours = _descendants({os.getpid()}, parent)
        workers = {p for p in ours if title.get(p, b"").startswith(WORKER_TITLE)}
        sandbox = in_sandbox | (_descendants(workers, parent) - workers)
        cluster = ours - sandbox - {os.getpid()}
        self._note("workers", len(workers))
        self._note("workers_pss_mb", _sum_pss(workers) / 2**20)
        self._note("workers_rss_mb", sum(_rss(p) for p in workers) / 2**20)
        self._note("workers_fds", sum(_fds(p) for p in workers))
        self._note("workers_threads", sum(_threads(p) for p in workers))
        self._note("cluster_processes", len(cluster))
        self._note("cluster_pss_mb", _sum_pss(cluster) / 2**20)
        if pss_due(len(sandbox), self._sandboxes_seen, self._pss_at, self._samples):
            self._note("sandbox_pss_mb", _sum_pss(sandbox) / 2**20)
            self._pss_at = len(sandbox)
        self._sandboxes_seen = len(sandbox)
        self._note("sandbox_processes", len(sandbox))
        self._samples += 1
        self._note("driver_fds", _fds(os.getpid()))
        self._note("driver_threads", threading.active_count())


def pss_due(count: int, seen: int, read_at: int, samples: int) -> bool:
    """Whether this sample reads the sandbox processes' PSS: ``count`` of them now, ``seen`` at the last
    sample, ``read_at`` at the last read, ``samples`` taken before (``PSS_EVERY``)."""
    return count <= seen and (samples % PSS_EVERY == 0 or count > read_at)


def _descendants(roots: set[int], parent: dict[int, int]) -> set[int]:
    found = set(roots)
    for _ in range(64):  # a tree deeper than this is no tree of ours
        more = {pid for pid, ppid in parent.items() if ppid in found} - found
        if not more:
            break
        found |= more
    return found


def _sum_pss(pids: Any) -> int:
    """Proportional set size: each shared page counted once over the processes sharing it, so that a
    thousand forks of one interpreter are not counted a thousand times."""
    total = 0
    for pid in pids:
        try:
            for row in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if row.startswith("Pss:"):
                    total += int(row.split()[1]) * 1024
                    break
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, ValueError):
            continue
    return total


def _rss(pid: int) -> int:
    try:
        for row in Path(f"/proc/{pid}/status").read_text().splitlines():
            if row.startswith("VmRSS:"):
                return int(row.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, ValueError):
        pass
    return 0


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0


_GROUPS = itertools.count()


class TreeCpu:
    """The CPU of this process and of everything it starts meanwhile (Ray, the workers, every sandbox
    process), exactly, whoever reaps whom, and nothing of the rest of the machine: from a cpuacct cgroup
    of its own (cgroup v1), which nothing of a run leaves (the sandboxes' pids cgroups are another
    hierarchy). ``seconds`` is None where it cannot be made (not root, no cpuacct hierarchy)."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    PARTS = ("workers", "sandboxes")

    def __init__(self) -> None:
        self.group: Path | None = None
        self.seconds: float | None = None
        self.parts: dict[str, float] = {}  # seconds by part (PARTS), within ``seconds``
        # Of each part's seconds, those its processes spent in the kernel (system calls, page faults):
        # most of it what the sandboxes' isolation asks of the kernel, whatever language asks it.
        self.kernel_parts: dict[str, float] = {}
        self.left: list[str] = []  # a part's group that still held a process at the end
        self._home: str | None = None

    def __enter__(self) -> TreeCpu:
        try:
            home = next(
                line.split(":", 2)[2]
                for line in Path("/proc/self/cgroup").read_text().splitlines()
                if "cpuacct" in line.split(":", 2)[1].split(",")
            )
            # A group per run: one left behind by the run before (a process of its cluster still
            # exiting) must not leave this one unmeasured.
            group = self.ROOT / home.lstrip("/") / f"rollout-bench-{os.getpid()}-{next(_GROUPS)}"
            group.mkdir()
            for part in self.PARTS:
                (group / part).mkdir()
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except (OSError, StopIteration, IndexError):
            return self
        self.group, self._home = group, home
        return self

    def exclude_this_thread(self) -> None:
        """Count the calling thread's CPU from now on where it was before (cgroup v1 moves threads one
        by one through ``tasks``): the bench's sampler is no part of the run."""
        if self.group is not None:
            with contextlib.suppress(OSError):
                (self.ROOT / str(self._home).lstrip("/") / "tasks").write_text(str(threading.get_native_id()))

    def unmoved(self) -> dict[int, int]:
        """The parent of each process in the run's own group or its workers' (a process is born in its
        parent's: what a worker starts is in theirs until moved), none of the sandboxes' group, whose
        thousands of processes a look at the machine's every process would read again and again."""
        if self.group is None:
            return {}
        pids: list[str] = []
        for group in (self.group, self.group / "workers"):
            with contextlib.suppress(OSError):
                pids += (group / "cgroup.procs").read_text().split()
        return {pid: int(fields[1]) for pid, fields in _stat_fields(map(int, pids))}

    def move(self, pid: int, part: str) -> bool:
        """Account process ``pid`` (every thread of it) and what it forks from now on to ``part``."""
        if self.group is None:
            return False
        try:
            (self.group / part / "cgroup.procs").write_text(str(pid))
        except OSError:
            return False
        return True

    def __exit__(self, *exc: object) -> None:
        if self.group is None:
            return
        for part in self.PARTS:
            with contextlib.suppress(OSError, ValueError):
                self.parts[part] = int((self.group / part / "cpuacct.usage").read_text()) / 1e9
                share = kernel_share((self.group / part / "cpuacct.stat").read_text())
                if share is not None:
                    self.kernel_parts[part] = self.parts[part] * share
            if not _remove_group(self.group / part):
                self.left.append(
                    f"{self.group / part}: {(self.group / part / 'cgroup.procs').read_text()[:200]}"
                )
        try:
            self.seconds = int((self.group / "cpuacct.usage").read_text()) / 1e9
            (self.ROOT / str(self._home).lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            pass
        # Where a process of the cluster is left in it past the bound, it stays, to be looked at.
        _remove_group(self.group)


def kernel_share(stat: str) -> float | None:
    """The share of a CPU group's time spent in the kernel, from its ``cpuacct.stat`` (``user`` and
    ``system`` in ticks: each tick charged to the mode it fell in, so a share over seconds of CPU, where
    the exact total is ``cpuacct.usage``'s); None where it holds no tick or cannot be read."""
    ticks: dict[str, int] = {}
    for entry in stat.splitlines():
        name, _, value = entry.partition(" ")
        if value.strip().isdigit():
            ticks[name] = int(value)
    user, system = ticks.get("user"), ticks.get("system")
    if user is None or system is None or user + system == 0:
        return None
    return system / (user + system)


def _remove_group(group: Path, timeout_s: float = 15.0) -> bool:
    """Remove a CPU group once the processes still exiting in it are gone (the cluster's last ones are
    ended just before); bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            group.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
        time.sleep(0.1)  # a condition, looked at again; bounded


def _own_cpu_s() -> float:
    """CPU of this process, every thread of it (those ended too)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def _tree_cpu_s() -> float:
    """CPU of this process and of the children it reaped (the cluster it started, once stopped, and
    through them the workers and what they reaped)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _command_by_hand_ms(command: str, n: int = 50) -> float:
    """CPU of the harness's own command (``sh -c COMMAND``), run ``n`` times by hand with its sleeps cut
    to 0: the part of a sandbox's CPU that is the command's, not the executor's."""
    import re

    quick = re.sub(r"sleep [0-9.]+", "sleep 0", command)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(n):
        subprocess.run(["sh", "-c", quick], stdout=subprocess.DEVNULL, check=True, timeout=30)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / n * 1000


def scale(
    sessions: int, workers: int, sleep_s: float, scratch: Path, nodes: int = 0, in_flight: int | None = None
) -> dict[str, Any]:
    """``sessions`` sessions of ``sleep sleep_s``, all in flight at once over ``workers`` workers; with
    ``nodes``, over that many raylets of this machine (`ray start`), the workers spread evenly. With
    ``in_flight``, that many at once: each session that ends makes room for the next, in waves, as a long
    run's sessions follow each other (a later sandbox may take an ended one's server)."""
    from executor.store import read_table
    from executor.testing.bench_common import _median_p90, _run_driver, _write_config, _write_tasks

    in_flight = min(in_flight or sessions, sessions)
    per_worker = math.ceil(in_flight / workers)
    tasks = _write_tasks(scratch / "f.jsonl", sessions)
    command = f"sleep {sleep_s:g}; echo done"
    # Says something at the end: a command that exits 0 silently never called the model (masked).
    extra = f"run_id: f{sessions}\nharness: {{name: command, command: '{command}'}}\n"
    extra += f"limits: {{deadline_s: {sleep_s * 4 + 60:g}}}\n"
    resources = ", worker_resources: {sandbox_slot: 1}" if nodes else ""
    extra += (
        f"concurrency: {{workers: {workers}, sessions_per_worker: {per_worker}, max_in_flight: {in_flight}"
        f"{resources}}}\n"
    )
    sandbox_root = scratch / "sb"
    command_ms = _command_by_hand_ms(command)
    cpu0, tree0, t0 = _machine_cpu_s(), _tree_cpu_s(), time.monotonic()
    kernel0, pages0 = _kernel_threads(), _pages_allocated()
    own0 = _own_cpu_s()
    with TreeCpu() as ours, Sampler(sandbox_root, ours, workers) as sampler:
        with contextlib.ExitStack() as stack:
            if nodes:
                address = stack.enter_context(raylets(nodes, math.ceil(workers / nodes), {}))
                extra += f"ray_address: {address!r}\n"
            config = _write_config(scratch, "f", tasks, extra)
            summary, wall = _run_driver(config)
        sampler_cpu = sampler.thread_cpu_s()
    # The driver is this process (its loop, its Ray client's threads), less the sampler's threads.
    driver_cpu = _own_cpu_s() - own0 - sampler_cpu
    cpu, tree = _machine_cpu_s() - cpu0, _tree_cpu_s() - tree0
    kernel, pages = _kernel_threads_cpu_s(kernel0), _pages_allocated() - pages0
    left = _left_behind(sandbox_root) + ours.left
    phases = ["t_setup_s", "t_agent_s", "t_verify_s", "t_cleanup_s"]
    columns = ["started_at", "t_total_s", "status", "failure_kind", "worker_id", *phases]
    cols = read_table(Path(summary.run_dir), columns).to_pydict()
    starts = [s.timestamp() for s in cols["started_at"]]
    # Each worker's first session: how much of the starts' spread is the workers' own start-up.
    firsts: dict[object, float] = {}
    for worker, start in zip(cols["worker_id"], starts, strict=True):
        firsts[worker] = min(start, firsts.get(worker, start))
    ends = [s + t for s, t in zip(starts, cols["t_total_s"], strict=True)]
    span = max(ends) - min(starts) if ends else 0.0
    waves = math.ceil(sessions / (per_worker * workers))
    ideal = sleep_s * waves
    statuses: dict[str, int] = {}
    for status, kind in zip(cols["status"], cols["failure_kind"], strict=True):
        key = f"{status}/{kind}" if kind else str(status)
        statuses[key] = statuses.get(key, 0) + 1
    rows = max(len(starts), 1)
    parts_ms = {k: v / rows * 1000 for k, v in ours.parts.items()}
    kernel_ms = {k: v / rows * 1000 for k, v in ours.kernel_parts.items()}
    if ours.seconds is not None and ours.parts:
        # What is neither a worker's nor a sandbox's: the driver, and Ray's own processes (GCS, raylets,
        # their agents, the `ray start` processes and the workers Ray starts idle).
        rest = ours.seconds - sum(ours.parts.values())
        parts_ms["driver"] = driver_cpu / rows * 1000
        parts_ms["cluster"] = (rest - driver_cpu) / rows * 1000
    return {
        "sessions": sessions,
        "in_flight": in_flight,
        "workers": workers,
        "nodes": nodes,
        "sessions_per_worker": per_worker,
        "sleep_s": sleep_s,
        "rows": len(starts),
        "outcomes": statuses,
        "left_behind": left,  # processes or directories of a sandbox, or a CPU group, still there
        "wall_s": wall,  # the driver's run: Ray's start, every session, the cluster's stop
        "sessions_span_s": span,  # the first session's start to the last one's end
        "ideal_s": ideal,
        "overhead_of_span": (span - ideal) / span if span else 0.0,
        "span_over_ideal": span / ideal - 1 if ideal else 0.0,
        "starts_spread_s": max(starts) - min(starts) if starts else 0.0,
        "workers_first_spread_s": max(firsts.values()) - min(starts) if starts else 0.0,
        "phase_median_p90_s": {
            name: _median_p90([v for v in cols[name] if v is not None]) for name in phases
        },
        "machine_cpu_s": cpu,  # everything the machine did meanwhile
        "kernel_threads_cpu_s": kernel,  # of which the kernel's threads (those alive at the end)
        # Pages the machine allocated meanwhile (each a page fault's or the kernel's own), per rollout: a
        # count the hour does not move, where a new page's CPU does (docs/performance.md, "At scale").
        "pages_per_rollout": pages / rows,
        # The driver, its cluster and every sandbox process: the run's whole cost (None: unmeasured).
        "run_cpu_s": ours.seconds,
        "run_cpu_ms_per_rollout": ours.seconds / rows * 1000 if ours.seconds else None,
        # The run's CPU by part, per rollout: the worker actors (sessions, gateway, rows), the sandboxes'
        # processes (fork server, supervisor servers, supervisors, inits, and the harness's commands),
        # the driver (this process less the sampler), and the cluster (Ray's processes).
        "parts_cpu_ms_per_rollout": parts_ms,
        # Of the workers' and the sandboxes' part, what their processes spent in the kernel.
        "parts_kernel_ms_per_rollout": kernel_ms,
        # What the harness's commands themselves take, by hand: to take from the sandboxes' part.
        "command_by_hand_cpu_ms": command_ms,
        "sampler_cpu_s": sampler_cpu,
        "tree_cpu_s": tree,  # this process and the cluster it started, once reaped
        "cpu_ms_per_rollout": tree / rows * 1000,
        "elapsed_s": time.monotonic() - t0,
        "driver_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **{f"peak_{k}": v for k, v in sampler.peak.items()},
    }


def _left_behind(sandbox_root: Path) -> list[str]:
    """A sandbox's process still running, or its directory still there, a few seconds after the run."""
    deadline = time.monotonic() + 10
    while (procs := processes_under(str(sandbox_root))) and time.monotonic() < deadline:
        time.sleep(0.2)  # a condition, looked at again; bounded
    # A worker's owner record (sandboxes/owner.py) stays for a reaper to see it is gone, and a run's
    # workspace templates (sandboxes/prepared.py) for its next run: neither is a session's.
    kept = {"owners", "prepared-workspaces"}
    dirs = [str(p) for p in sandbox_root.glob("*/*") if p.parent.name not in kept and p.name not in kept]
    # Every one counted; the first 20 of each named.
    return (
        [f"{len(procs)} processes, {len(dirs)} directories", *procs[:20], *dirs[:20]] if procs or dirs else []
    )


def parts_text(per: dict[str, float], kernel: dict[str, float], unit: str = "") -> str:
    """CPU by part, each with what of it was spent in the kernel where that is known."""
    return ", ".join(
        f"{k} {v:.1f}{unit}" + (f" (in the kernel {kernel[k]:.1f})" if k in kernel else "")
        for k, v in per.items()
    )


def line(f: dict[str, Any]) -> str:
    p = {k.removeprefix("peak_"): v for k, v in f.items() if k.startswith("peak_")}
    nodes = f" on {f['nodes']} raylets" if f.get("nodes") else ""
    parts = f.get("parts_cpu_ms_per_rollout") or {}
    by_part = (
        "CPU per rollout by part: "
        + parts_text(parts, f.get("parts_kernel_ms_per_rollout") or {}, " ms")
        + f" (the command alone, by hand, {f.get('command_by_hand_cpu_ms', 0):.1f} ms); "
        if parts
        else ""
    )
    left = f.get("left_behind") or []
    return (
        f"(f) {f['sessions']:,} sessions of `sleep {f['sleep_s']:g}` "
        + (f"{f['in_flight']:,} at once" if f.get("in_flight", f["sessions"]) < f["sessions"] else "at once")
        + f" ({f['workers']} workers x "
        f"{f['sessions_per_worker']}{nodes}): sessions' span {f['sessions_span_s']:.1f} s against "
        f"{f['ideal_s']:.0f} s ideal (overhead {f['overhead_of_span']:.1%} of the span), whole run "
        f"{f['wall_s']:.1f} s; CPU of the driver and its cluster {f['tree_cpu_s']:.0f} s "
        f"({f['cpu_ms_per_rollout']:.0f} ms per rollout; the machine's {f['machine_cpu_s']:.0f} s, "
        f"its kernel threads' {f.get('kernel_threads_cpu_s', 0):.0f} s of it; the pages it allocated, "
        f"{f.get('pages_per_rollout', 0):,.0f} per rollout); "
        + (
            f"CPU of the run as a whole, its sandboxes included, {f['run_cpu_s']:.0f} s "
            f"({f['run_cpu_ms_per_rollout']:.0f} ms per rollout); "
            if f.get("run_cpu_s")
            else ""
        )
        + by_part
        + f"left behind: {left[0] + ' ' + str(left[1:4]) if left else 'nothing'}; "
        + "peaks: "
        f"driver RSS {f['driver_peak_rss_mb']:.0f} MB, fds {p.get('driver_fds', 0):.0f}, threads "
        f"{p.get('driver_threads', 0):.0f}; {p.get('workers', 0):.0f} workers' PSS "
        f"{p.get('workers_pss_mb', 0):.0f} MB (RSS {p.get('workers_rss_mb', 0):.0f} MB), fds "
        f"{p.get('workers_fds', 0):.0f}, threads "
        f"{p.get('workers_threads', 0):.0f}; other cluster processes "
        f"{p.get('cluster_processes', 0):.0f} (PSS {p.get('cluster_pss_mb', 0):.0f} MB); sandbox "
        f"processes {p.get('sandbox_processes', 0):.0f} (PSS {p.get('sandbox_pss_mb', 0):.0f} MB); "
        f"outcomes {f['outcomes']}; the last session started {f['starts_spread_s']:.1f} s after the first "
        f"(the last worker's first {f['workers_first_spread_s']:.1f} s after); "
        "phases median/p90 s: "
        + ", ".join(f"{k[2:-2]} {m:.2f}/{q:.2f}" for k, (m, q) in f["phase_median_p90_s"].items())
    )


def scale_and_fixed(
    sessions: int,
    workers: int,
    sleep_s: float,
    scratch: Path,
    nodes: int,
    echo: Any,
    in_flight: int | None = None,
) -> dict[str, Any]:
    """``scale`` after a run of one session per worker (each in a directory of its own under ``scratch``),
    its figures with ``beyond_fixed`` of the two; ``echo`` says each run's line as it ends."""
    runs = []
    for name, n in (("fixed", workers), ("run", sessions)):
        (scratch / name).mkdir()
        runs.append(scale(n, workers, sleep_s, scratch / name, nodes, in_flight))
        echo(line(runs[-1]))
    figures = runs[-1]
    figures["beyond_fixed"] = beyond_fixed(runs[0], figures)
    if figures["beyond_fixed"]:
        echo(fixed_line(figures["beyond_fixed"]))
    return figures


def beyond_fixed(small: dict[str, Any], big: dict[str, Any]) -> dict[str, Any]:
    """What one more session costs by part, and the run's fixed costs, from two runs of ``scale`` that
    differ only in their number of sessions: the cluster's start, each worker process's start and
    imports, the driver's own are paid once a run (and once a cluster), not per session, and a run of
    1,000 sessions on a fresh cluster carries them as ~30 ms a rollout."""
    rows = big["rows"] - small["rows"]
    small_parts, big_parts = small["parts_cpu_ms_per_rollout"], big["parts_cpu_ms_per_rollout"]
    if rows <= 0 or not small_parts or not big_parts:
        return {}

    def per_session(small_ms: dict[str, float], big_ms: dict[str, float]) -> dict[str, float]:
        return {
            part: (big_ms[part] * big["rows"] - small_ms[part] * small["rows"]) / rows
            for part in big_ms
            if part in small_ms
        }

    per = per_session(small_parts, big_parts)
    kernel = per_session(
        small.get("parts_kernel_ms_per_rollout") or {}, big.get("parts_kernel_ms_per_rollout") or {}
    )
    fixed_s = {part: (small_parts[part] - per[part]) * small["rows"] / 1000 for part in per}
    # The workers' memory at their peak, every session in flight, beyond a run of one each: what a
    # session in flight holds in its worker (the sandbox's own processes not counted).
    pss = big.get("peak_workers_pss_mb", 0) - small.get("peak_workers_pss_mb", 0)
    in_flight = big.get("in_flight", big["sessions"]) - small.get("in_flight", small["sessions"])
    pages = big.get("pages_per_rollout", 0) * big["rows"] - small.get("pages_per_rollout", 0) * small["rows"]
    return {
        "per_session_ms": per,
        "kernel_per_session_ms": kernel,  # of ``per_session_ms``, the kernel's (workers and sandboxes)
        "fixed_s": fixed_s,
        "small_rows": small["rows"],
        "worker_mb_per_session": pss / in_flight if in_flight > 0 else None,
        "pages_per_session": pages / rows,  # the machine's, as ``per_session_ms``
    }


def fixed_line(figures: dict[str, Any]) -> str:
    per, fixed = figures["per_session_ms"], figures["fixed_s"]
    return (
        f"(f) beyond the run's fixed costs (the difference from a run of {figures['small_rows']} sessions): "
        f"{sum(per.values()):.1f} ms of CPU per session: "
        + parts_text(per, figures.get("kernel_per_session_ms") or {})
        + f" ms; fixed, once a run: {sum(fixed.values()):.1f} s: "
        + ", ".join(f"{k} {v:.1f}" for k, v in fixed.items())
        + f" s; pages the machine allocated per session: {figures.get('pages_per_session', 0):,.0f}"
        + (
            f"; workers' memory (PSS) per session in flight: {mb:.2f} MB"
            if (mb := figures.get("worker_mb_per_session")) is not None
            else ""
        )
    )


# ----------------------------------------------------------------------------------------------------
# The provider-level probe: what one local sandbox costs the machine, without Ray or a session around it


def sandbox_cpu(
    n: int,
    scratch: Path,
    isolation: str = "auto",
    execs: int = 1,
    sleep_s: float = 0.0,
    rounds: int = 1,
) -> dict[str, Any]:
    """``n`` local sandboxes at once, as a run's defaults make them: start, ``execs`` commands of ``true``
    one after another, stop. (Two runs with different ``execs`` give what one more command costs.)
    ``sleep_s``: the last command is ``sleep sleep_s`` instead, every sandbox's at once, so that two runs
    with different ``sleep_s`` give what a sandbox costs while its command waits. ``rounds``: ``n`` at once
    that many times, each round once the one before has stopped, as a run's sessions follow each other
    (what a sandbox leaves for the next one to take counts); the figures are per sandbox of all rounds.

    The CPU is this process's and its reaped children's (the supervisor servers and everything under
    them, and the provider's fork server once the provider is closed), so it excludes the rest of the
    machine; the provider's construction (its probes of what the host allows) is left out, one sandbox
    before the ``n`` (the first spare server's start) is counted in."""
    import asyncio
    import uuid

    from sandboxes.base import SandboxSpec
    from sandboxes.local_config import LocalSandboxConfig

    gateway = scratch / "gateway.sock"  # a listening socket; the probe's `true` never connects
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(gateway))
    listener.listen()
    config = LocalSandboxConfig(isolation=isolation, keep=False)
    forward = (8, str(gateway)) if config.needs_gateway_socket else None
    provider = config.build(scratch / "sb", forward)
    run_id = f"probe-{uuid.uuid4().hex[:6]}"

    def spec() -> SandboxSpec:
        return SandboxSpec(run_id=run_id, session_id=uuid.uuid4().hex[:12], ttl_s=600)

    async def one() -> Any:
        sandbox = await provider.start(spec())
        for i in range(execs):
            argv = ["sleep", f"{sleep_s:g}"] if sleep_s and i == execs - 1 else ["true"]
            result = await sandbox.exec(argv, timeout=sleep_s + 60)
            if result.exit_code != 0:
                await sandbox.stop()
                raise RuntimeError(f"`true` in a probe sandbox: {result}")
        return sandbox

    async def main() -> tuple[float, float, int]:
        t0 = time.monotonic()
        threads = 0
        for _ in range(rounds):
            sandboxes = await asyncio.gather(*(one() for _ in range(n)))
            threads = max(threads, threading.active_count())  # every sandbox started, none stopped
            await asyncio.gather(*(sandbox.stop() for sandbox in sandboxes))
        wall = time.monotonic() - t0
        await provider.aclose()
        return wall, time.monotonic() - t0, threads

    own0 = resource.getrusage(resource.RUSAGE_SELF)
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine0 = _machine_cpu_s()
    peak_threads = 0
    try:
        wall, wall_closed, peak_threads = asyncio.run(main())
    finally:
        listener.close()
    own1 = resource.getrusage(resource.RUSAGE_SELF)
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = own1.ru_utime + own1.ru_stime - own0.ru_utime - own0.ru_stime
    kids = kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime
    n *= rounds
    return {
        "sandboxes": n,
        "rounds": rounds,
        "execs": execs,
        "sleep_s": sleep_s,
        "isolation": provider.isolation_label,
        "wall_s": wall,
        "wall_closed_s": wall_closed,
        "worker_cpu_ms_per_sandbox": own / n * 1000,
        "processes_cpu_ms_per_sandbox": kids / n * 1000,
        "cpu_ms_per_sandbox": (own + kids) / n * 1000,
        "machine_cpu_ms_per_sandbox": (_machine_cpu_s() - machine0) / n * 1000,
        "threads_all_started": peak_threads,
    }


def sandbox_line(p: dict[str, Any]) -> str:
    last = f", the last `sleep {p['sleep_s']:g}`" if p.get("sleep_s") else ""
    rounds = p.get("rounds", 1)
    at_once = f"{p['sandboxes'] // rounds} at once, {rounds} rounds" if rounds > 1 else "at once"
    return (
        f"{p['sandboxes']} local sandboxes ({p['isolation']}) {at_once}, start + {p['execs']} x `true`{last}"
        " + stop: "
        f"{p['cpu_ms_per_sandbox']:.1f} ms CPU per sandbox ({p['worker_cpu_ms_per_sandbox']:.1f} in the "
        f"worker, {p['processes_cpu_ms_per_sandbox']:.1f} in its processes; the whole machine "
        f"{p['machine_cpu_ms_per_sandbox']:.1f}), wall {p['wall_s']:.2f} s, worker threads with all "
        f"started {p['threads_all_started']}"
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m executor.testing.bench_scale --sessions N --workers W --sleep S [--nodes R]``: part
    (f) alone, with the raylets `rollout bench` does not start."""
    import argparse

    parser = argparse.ArgumentParser(prog="bench_scale")
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--sleep", type=float, default=30.0)
    parser.add_argument("--nodes", type=int, default=0, help="raylets of this machine (0: a local cluster)")
    parser.add_argument(
        "--in-flight", type=int, default=None, help="sessions at once (default: all), the rest in waves"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--fixed",
        action="store_true",
        help="first a run of one session per worker, to report the CPU per session beyond the fixed costs",
    )
    args = parser.parse_args(argv)
    import shutil

    scratch = Path(tempfile.mkdtemp(prefix="rollout-bench-", dir=str(Path.home())))
    try:
        if args.fixed:
            echo = functools.partial(print, flush=True)
            figures = scale_and_fixed(
                args.sessions, args.workers, args.sleep, scratch, args.nodes, echo, args.in_flight
            )
        else:
            figures = scale(args.sessions, args.workers, args.sleep, scratch, args.nodes, args.in_flight)
            print(line(figures), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
