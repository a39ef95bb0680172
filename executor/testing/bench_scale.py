"""`rollout bench --parts f`: many sessions in flight at once on this machine.

A null harness that sleeps (``sleep S``) in local sandboxes, ``workers x sessions_per_worker`` of them at
once, so every session waits the same ``S`` seconds and whatever the run takes beyond ``S`` per wave is
the executor's. While it runs, a sampler reads /proc every ``SAMPLE_S``: the processes under the run's
sandbox root (supervisor servers, supervisors, the harness commands), the worker actors' and the
driver's memory and file descriptors, and the machine's CPU time.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

SAMPLE_S = 1.0
# The sandbox processes' PSS (smaps_rollup of thousands of processes, the sampler's dearest read) is read
# every this many samples, and whenever their count reaches a new peak; their count every sample.
PSS_EVERY = 5
_TICK = os.sysconf("SC_CLK_TCK")
WORKER_TITLE = b"ray::SandboxWorker"


def _machine_cpu_s() -> float:
    """CPU seconds spent by the whole machine since boot, idle and iowait excluded."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    values = [int(v) for v in fields]
    busy = sum(values) - values[3] - values[4]  # idle, iowait
    return busy / _TICK


class Sampler:
    """Peaks of what a run holds, read from /proc on a thread of its own until ``stop``."""

    def __init__(self, sandbox_root: Path, cpu: TreeCpu | None = None) -> None:
        self.marker = str(sandbox_root).encode()
        self.peak: dict[str, float] = {}
        self._cpu = cpu
        self._samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _note(self, name: str, value: float) -> None:
        self.peak[name] = max(self.peak.get(name, 0), value)

    def _loop(self) -> None:
        # The measuring is not the run's: this thread leaves the run's CPU account, and yields the CPU to
        # the run (reading /proc for 5,000 processes took ~15 ms per rollout of a 1,000-session run).
        if self._cpu is not None:
            self._cpu.exclude_this_thread()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        """One look at every process: this process's descendants are the cluster it started (GCS,
        raylet, worker actors); a process working under the sandbox root is a sandbox's, wherever it
        hangs in the tree (a sandbox's supervisor server leaves the worker's process group)."""
        parent: dict[int, int] = {}
        title: dict[int, bytes] = {}
        in_sandbox: set[int] = set()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                stat = Path(f"/proc/{pid}/stat").read_bytes()
                parent[pid] = int(stat.rsplit(b")", 1)[1].split()[1])
                title[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()[:64]
                if os.readlink(f"/proc/{pid}/cwd").encode().startswith(self.marker):
                    in_sandbox.add(pid)
            except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, ValueError):
                continue
        ours = _descendants({os.getpid()}, parent)
        workers = {p for p in ours if title.get(p, b"").startswith(WORKER_TITLE)}
        sandbox = in_sandbox | (_descendants(workers, parent) - workers)
        cluster = ours - sandbox - {os.getpid()}
        self._note("workers", len(workers))
        self._note("workers_pss_mb", _sum_pss(workers) / 2**20)
        self._note("workers_fds", sum(_fds(p) for p in workers))
        self._note("workers_threads", sum(_threads(p) for p in workers))
        self._note("cluster_processes", len(cluster))
        self._note("cluster_pss_mb", _sum_pss(cluster) / 2**20)
        if self._samples % PSS_EVERY == 0 or len(sandbox) > self.peak.get("sandbox_processes", 0):
            self._note("sandbox_pss_mb", _sum_pss(sandbox) / 2**20)
        self._note("sandbox_processes", len(sandbox))
        self._samples += 1
        self._note("driver_fds", _fds(os.getpid()))
        self._note("driver_threads", threading.active_count())


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


class TreeCpu:
    """The CPU of this process and of everything it starts meanwhile (Ray, the workers, every sandbox
    process), exactly, whoever reaps whom, and nothing of the rest of the machine: from a cpuacct cgroup
    of its own (cgroup v1), which nothing of a run leaves (the sandboxes' pids cgroups are another
    hierarchy). ``seconds`` is None where it cannot be made (not root, no cpuacct hierarchy)."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self) -> None:
        self.group: Path | None = None
        self.seconds: float | None = None
        self._home: str | None = None

    def __enter__(self) -> TreeCpu:
        try:
            home = next(
                line.split(":", 2)[2]
                for line in Path("/proc/self/cgroup").read_text().splitlines()
                if "cpuacct" in line.split(":", 2)[1].split(",")
            )
            group = self.ROOT / home.lstrip("/") / f"rollout-bench-{os.getpid()}"
            group.mkdir()
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

    def __exit__(self, *exc: object) -> None:
        if self.group is None:
            return
        try:
            self.seconds = int((self.group / "cpuacct.usage").read_text()) / 1e9
            (self.ROOT / str(self._home).lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))
            self.group.rmdir()  # fails while a process is left in it: then it stays, to be looked at
        except OSError:
            pass


def _tree_cpu_s() -> float:
    """CPU of this process and of the children it reaped (the cluster it started, once stopped, and
    through them the workers and what they reaped)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def scale(sessions: int, workers: int, sleep_s: float, scratch: Path) -> dict[str, Any]:
    """``sessions`` sessions of ``sleep sleep_s``, all in flight at once over ``workers`` workers."""
    from executor.store import read_table
    from executor.testing.bench_common import _median_p90, _run_driver, _write_config, _write_tasks

    per_worker = math.ceil(sessions / workers)
    tasks = _write_tasks(scratch / "f.jsonl", sessions)
    extra = (
        # Says something at the end: a command that exits 0 silently never called the model (masked).
        f"run_id: f{sessions}\nharness: {{name: command, command: 'sleep {sleep_s:g}; echo done'}}\n"
        f"limits: {{deadline_s: {sleep_s * 4 + 60:g}}}\n"
        f"concurrency: {{workers: {workers}, sessions_per_worker: {per_worker}, max_in_flight: {sessions}}}\n"
    )
    config = _write_config(scratch, "f", tasks, extra)
    cpu0, tree0, t0 = _machine_cpu_s(), _tree_cpu_s(), time.monotonic()
    with TreeCpu() as ours, Sampler(scratch / "sb", ours) as sampler:
        summary, wall = _run_driver(config)
    cpu, tree = _machine_cpu_s() - cpu0, _tree_cpu_s() - tree0
    phases = ["t_setup_s", "t_agent_s", "t_verify_s", "t_cleanup_s"]
    columns = ["started_at", "t_total_s", "status", "failure_kind", *phases]
    cols = read_table(Path(summary.run_dir), columns).to_pydict()
    starts = [s.timestamp() for s in cols["started_at"]]
    ends = [s + t for s, t in zip(starts, cols["t_total_s"], strict=True)]
    span = max(ends) - min(starts) if ends else 0.0
    waves = math.ceil(sessions / (per_worker * workers))
    ideal = sleep_s * waves
    statuses: dict[str, int] = {}
    for status, kind in zip(cols["status"], cols["failure_kind"], strict=True):
        key = f"{status}/{kind}" if kind else str(status)
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "sessions": sessions,
        "workers": workers,
        "sessions_per_worker": per_worker,
        "sleep_s": sleep_s,
        "rows": len(starts),
        "outcomes": statuses,
        "wall_s": wall,  # the driver's run: Ray's start, every session, the cluster's stop
        "sessions_span_s": span,  # the first session's start to the last one's end
        "ideal_s": ideal,
        "overhead_of_span": (span - ideal) / span if span else 0.0,
        "starts_spread_s": max(starts) - min(starts) if starts else 0.0,
        "phase_median_p90_s": {
            name: _median_p90([v for v in cols[name] if v is not None]) for name in phases
        },
        "machine_cpu_s": cpu,  # everything the machine did meanwhile
        # The driver, its cluster and every sandbox process: the run's whole cost (None: unmeasured).
        "run_cpu_s": ours.seconds,
        "run_cpu_ms_per_rollout": ours.seconds / max(len(starts), 1) * 1000 if ours.seconds else None,
        "tree_cpu_s": tree,  # this process and the cluster it started, once reaped
        "cpu_ms_per_rollout": tree / max(len(starts), 1) * 1000,
        "elapsed_s": time.monotonic() - t0,
        "driver_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **{f"peak_{k}": v for k, v in sampler.peak.items()},
    }


def line(f: dict[str, Any]) -> str:
    p = {k.removeprefix("peak_"): v for k, v in f.items() if k.startswith("peak_")}
    return (
        f"(f) {f['sessions']:,} sessions of `sleep {f['sleep_s']:g}` at once ({f['workers']} workers x "
        f"{f['sessions_per_worker']}): sessions' span {f['sessions_span_s']:.1f} s against "
        f"{f['ideal_s']:.0f} s ideal (overhead {f['overhead_of_span']:.1%} of the span), whole run "
        f"{f['wall_s']:.1f} s; CPU of the driver and its cluster {f['tree_cpu_s']:.0f} s "
        f"({f['cpu_ms_per_rollout']:.0f} ms per rollout; the machine's {f['machine_cpu_s']:.0f} s); "
        + (
            f"CPU of the run as a whole, its sandboxes included, {f['run_cpu_s']:.0f} s "
            f"({f['run_cpu_ms_per_rollout']:.0f} ms per rollout); "
            if f.get("run_cpu_s")
            else ""
        )
        + "peaks: "
        f"driver RSS {f['driver_peak_rss_mb']:.0f} MB, fds {p.get('driver_fds', 0):.0f}, threads "
        f"{p.get('driver_threads', 0):.0f}; {p.get('workers', 0):.0f} workers' PSS "
        f"{p.get('workers_pss_mb', 0):.0f} MB, fds {p.get('workers_fds', 0):.0f}, threads "
        f"{p.get('workers_threads', 0):.0f}; other cluster processes "
        f"{p.get('cluster_processes', 0):.0f} (PSS {p.get('cluster_pss_mb', 0):.0f} MB); sandbox "
        f"processes {p.get('sandbox_processes', 0):.0f} (PSS {p.get('sandbox_pss_mb', 0):.0f} MB); "
        f"outcomes {f['outcomes']}; the last session started {f['starts_spread_s']:.1f} s after the first; "
        "phases median/p90 s: "
        + ", ".join(f"{k[2:-2]} {m:.2f}/{q:.2f}" for k, (m, q) in f["phase_median_p90_s"].items())
    )


# ----------------------------------------------------------------------------------------------------
# The provider-level probe: what one local sandbox costs the machine, without Ray or a session around it


def sandbox_cpu(n: int, scratch: Path, isolation: str = "auto", execs: int = 1) -> dict[str, Any]:
    """``n`` local sandboxes at once, as a run's defaults make them: start, ``execs`` commands of ``true``
    one after another, stop. (Two runs with different ``execs`` give what one more command costs.)

    The CPU is this process's and its reaped children's (the supervisor servers and everything under
    them, and the provider's fork server once the provider is closed), so it excludes the rest of the
    machine; the provider's construction (its probes of what the host allows) is left out, one sandbox
    before the ``n`` (the first spare server's start) is counted in."""
    import asyncio
    import socket
    import uuid

    from sandboxes.base import SandboxSpec
    from sandboxes.local import LocalSandboxConfig

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
        for _ in range(execs):
            result = await sandbox.exec(["true"], timeout=60)
            if result.exit_code != 0:
                await sandbox.stop()
                raise RuntimeError(f"`true` in a probe sandbox: {result}")
        return sandbox

    async def main() -> tuple[float, float, int]:
        t0 = time.monotonic()
        sandboxes = await asyncio.gather(*(one() for _ in range(n)))
        threads = threading.active_count()  # every sandbox started, none stopped
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
    return {
        "sandboxes": n,
        "execs": execs,
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
    return (
        f"{p['sandboxes']} local sandboxes ({p['isolation']}) at once, start + {p['execs']} x `true` + stop: "
        f"{p['cpu_ms_per_sandbox']:.1f} ms CPU per sandbox ({p['worker_cpu_ms_per_sandbox']:.1f} in the "
        f"worker, {p['processes_cpu_ms_per_sandbox']:.1f} in its processes; the whole machine "
        f"{p['machine_cpu_ms_per_sandbox']:.1f}), wall {p['wall_s']:.2f} s, worker threads with all "
        f"started {p['threads_all_started']}"
    )
