"""`rollout bench`: what the executor itself costs, measured side by side with doing without it.

(a) overhead per rollout: the real Codex harness through the executor's worker actor, one session at a
    time, versus the same rollout by hand against the same scripted model (a fresh workspace and config,
    `codex exec`, the verifier; `codex exec` alone is printed too), the two interleaved run by run;
(b) machinery throughput: a null harness (a command that exits at once) through the executor, versus a
    plain asyncio runner doing the same sessions (same sandboxes, same harness) without Ray, Arrow or policy;
(c) driver memory: peak RSS of a driver process for N and 10*N rollouts (null workers, so the driver's
    loop, Ray transport, Arrow store and policy are what is measured);
(d) the Arrow store: rows per second appended, and the time to resume-scan a large run;
(e) a run's fixed costs: the real `rollout run` command, cold, in a fresh process each time, on a small
    batch of one-tool Codex rollouts; when each phase (CLI imported, config read, Ray up, first worker
    ready, first row, last row, summary, exit) fell, in seconds after the command was spawned;
(g) (a) in containers: the executor's sandboxes are containers of one image (``--provider container``'s,
    else the tests' base image), against `codex exec` run by hand with `podman run --rm` in that image.
Figures are printed, never asserted: speed is measured here, not in tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = "Create a file hello.txt containing exactly the line: hello world"
SCRIPT = [
    {"type": "shell", "command": "printf 'hello world\\n' > hello.txt"},
    {"type": "text", "text": "Created hello.txt."},
]
VERIFY = "grep -qx 'hello world' hello.txt"
NULL_COMMAND = "echo done"


def _median_p90(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _write_config(scratch: Path, name: str, tasks: Path, extra: str, isolation: str | None = None) -> Path:
    path = scratch / f"{name}.yaml"
    sandbox = f"root: {scratch / 'sb'}" + (f", isolation: {isolation}" if isolation else "")
    path.write_text(f"tasks: {tasks}\nout: {scratch / 'out'}\nsandbox: {{{sandbox}}}\n{extra}")
    return path


def _write_tasks(path: Path, n: int, **fields: Any) -> Path:
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"b{i:06d}", "prompt": PROMPT, **fields}) + "\n")
    return path


def _run_driver(cfg_path: Path, worker_class: Any = None) -> tuple[Any, float]:
    import ray

    from executor.api import Executor
    from executor.config import load_config

    cfg = load_config(cfg_path)
    kind = {} if worker_class is None else {"worker_class": worker_class}
    executor = Executor(cfg, progress=True, **kind)
    t0 = time.perf_counter()
    try:
        summary = executor.run()
    finally:
        ray.shutdown()
    return summary, time.perf_counter() - t0


# (a) ------------------------------------------------------------------------------------------------


class _ModelThread:
    """The scripted model on its own event loop thread, for runs that are not asyncio themselves."""

    def __init__(self) -> None:
        from harnesses.testing.scripted_model import ScriptedModel, parse_steps

        self.loop = asyncio.new_event_loop()
        self.model = ScriptedModel(default_script=parse_steps(SCRIPT))
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.model.start(), self.loop).result(timeout=30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.model.stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _direct_runs(
    indices: range,
    model: Any,
    codex_js: Path,
    scratch: Path,
    direct: list[float],
    direct_codex: list[float],
    in_container: Callable[[list[str], dict[str, str], Path], list[str]] | None = None,
) -> None:
    """Hand-rolled rollouts: the same Codex task against the same scripted model, without the executor.
    ``in_container`` turns the command into one that runs it in a container, as one would by hand."""
    for i in indices:
        # Timed from here: what a hand-rolled loop does for one rollout too (a fresh workspace and
        # config, the harness, the grade), so the difference is what the executor adds.
        t0 = time.perf_counter()
        home = scratch / f"direct-{i}"
        (home / "work").mkdir(parents=True)
        (home / "codex").mkdir()
        base = model.model.base_url.removesuffix("/v1")
        (home / "codex" / "config.toml").write_text(
            'model = "scripted-model"\nmodel_provider = "bench"\napproval_policy = "never"\n'
            'sandbox_mode = "danger-full-access"\ncheck_for_update_on_startup = false\n'
            f'[model_providers.bench]\nname = "bench"\nbase_url = "{base}/s/d{i}/v1"\n'
            'env_key = "BENCH_KEY"\nwire_api = "responses"\n[analytics]\nenabled = false\n'
            "[feedback]\nenabled = false\n"
        )
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(home),
            "CODEX_HOME": str(home / "codex"),
            "BENCH_KEY": "k",
        }
        argv = [
            shutil.which("node") or "node",
            str(codex_js),
            "exec",
            "--json",
            "--skip-git-repo-check",
            "-C",
            str(home / "work"),
            PROMPT,
        ]
        if in_container is not None:
            argv = in_container(argv[2:], env, home)
        t1 = time.perf_counter()
        proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
        direct_codex.append(time.perf_counter() - t1)
        graded = subprocess.run(["bash", "-c", VERIFY], cwd=home / "work", capture_output=True, timeout=9)
        direct.append(time.perf_counter() - t0)
        if proc.returncode != 0 or graded.returncode != 0:
            raise RuntimeError(f"direct codex run failed: {proc.stderr[-2000:]!r}")


def _podman_by_hand(
    container: Any, install: Path, image: str
) -> Callable[[list[str], dict[str, str], Path], list[str]]:
    """How one runs `codex exec` in a container of ``image`` by hand: its native binary from the install,
    the rollout's directory mounted, the host's network to reach the model."""
    from harnesses.codex import native_binary

    binary = str(native_binary(install))

    def wrap(args: list[str], env: dict[str, str], home: Path) -> list[str]:
        argv = [container.engine, "run", "--rm", "--network", "host", "-v", f"{home}:{home}"]
        argv += ["-v", f"{install}:{install}:ro"]
        argv += ["--runtime", container.runtime] if container.runtime else []
        for ulimit in container.ulimits:
            argv += ["--ulimit", ulimit]
        for key in ("HOME", "CODEX_HOME", "BENCH_KEY"):
            argv += ["-e", f"{key}={env[key]}"]
        return [*argv, "--entrypoint", binary, image, *args]

    return wrap


def default_container() -> Any:
    """(g)'s container section when none is given: the tests' base image (built once per machine), with
    runc where it is installed (crun refuses cgroups in hybrid mode), and limits every engine can apply
    (the by-hand side passes them to `podman run` as they are)."""
    from sandboxes.container import ContainerSandboxConfig
    from sandboxes.testing.images import ensure_test_images

    runtime = {"runtime": "runc"} if shutil.which("runc") else {}
    limits = ["nofile=1024:1024", "nproc=1024:1024"]
    return ContainerSandboxConfig(image=ensure_test_images().base, ulimits=limits, **runtime)


def overhead(runs: int, scratch: Path, container: Any = None, isolation: str | None = None) -> dict[str, Any]:
    """Hand-rolled rollouts and rollouts through a Ray worker actor, interleaved one by one: this VM's
    speed drifts by tens of percent over a minute, and alternating makes the drift hit both sides.
    ``container`` (a ContainerSandboxConfig): the executor's sandboxes are containers so configured, and
    each hand-rolled `codex exec` runs in a container of the same image."""
    import ray

    from executor.config import load_config
    from executor.driver import connect_ray
    from executor.schema import batch_from_wire
    from executor.tasks import load_tasks
    from executor.worker import SandboxWorker
    from harnesses.codex import CodexHarness
    from harnesses.install import default_cache_root
    from sandboxes.local import LocalSandboxProvider

    class MeasuredWorker(SandboxWorker):
        async def finish_removals(self) -> None:
            """Wait for the last sandbox's deletion, which runs after its row: not during the next direct
            run, which must not share the machine with it."""
            if isinstance(self.provider, LocalSandboxProvider):  # a container is removed at its stop
                await self.provider.finish_removals()

    install = CodexHarness().ensure_installed(default_cache_root())
    codex_js = install / "node_modules" / "@openai" / "codex" / "bin" / "codex.js"
    tasks = _write_tasks(scratch / "a.jsonl", runs, model_script=SCRIPT, verify=VERIFY)
    cfg = load_config(
        _write_config(scratch, "a", tasks, "concurrency: {workers: 1, sessions_per_worker: 1}\n", isolation)
    )
    wrap = None
    if container is not None:
        cfg = cfg.model_copy(update={"sandbox": container.model_copy(update={"root": str(scratch / "sb")})})
        wrap = _podman_by_hand(container, install, container.image)
    direct: list[float] = []
    direct_codex: list[float] = []
    rows: list[dict[str, Any]] = []
    connect_ray(cfg)
    model = _ModelThread()
    try:
        # The actor the driver would start for this config, able to wait for deletions; its row's
        # t_total_s is the session's time.
        worker = (
            ray.remote(MeasuredWorker)
            .options(num_cpus=0, max_concurrency=4)
            .remote(cfg.model_dump_json(), str(scratch / "out" / "a"), 0)
        )
        for i, task in enumerate(load_tasks(tasks)):
            _direct_runs(range(i, i + 1), model, codex_js, scratch, direct, direct_codex, wrap)
            rows.extend(batch_from_wire(ray.get(worker.run.remote(task.model_dump_json(), 0, 1))).to_pylist())
            ray.get(worker.finish_removals.remote())
    finally:
        model.stop()
        ray.shutdown()
    if any(r["reward"] != 1.0 for r in rows):
        raise RuntimeError(
            f"executor overhead run did not solve every task: {[r['error_message'] for r in rows]}"
        )
    # The first two of each side are warm-up (the actor's first session, Codex's first start).
    warm = slice(2, None) if runs > 4 else slice(None)
    total = [r["t_total_s"] for r in rows][warm]
    d, e, h = (_median_p90(x) for x in (direct[warm], total, [r["t_agent_s"] for r in rows][warm]))
    return {
        "runs": runs,
        "provider": "local" if container is None else "container",
        "image": None if container is None else container.image,
        "direct_median_s": d[0],
        "direct_p90_s": d[1],
        "direct_codex_only_median_s": _median_p90(direct_codex[warm])[0],
        "executor_session_median_s": e[0],
        "executor_session_p90_s": e[1],
        "executor_harness_phase_median_s": h[0],
        # Setup, verify (diff, evidence, verifier) and cleanup: what the executor adds around the harness.
        **{
            f"executor_{phase}_phase_median_s": statistics.median(r[f"t_{phase}_s"] for r in rows[warm])
            for phase in ("setup", "verify", "cleanup")
        },
        "ratio": e[0] / d[0],
        "pairwise_ratio_median": statistics.median(x / y for x, y in zip(total, direct[warm], strict=True)),
    }


# (b) ------------------------------------------------------------------------------------------------


async def _plain_runner(n: int, concurrency: int, scratch: Path) -> tuple[float, list[float]]:
    """The same sessions as the executor runs, in one asyncio process: no Ray, no Arrow, no policy.
    Its wall time and when each session ended."""
    from executor.config import load_config
    from executor.session import SessionContext, SessionRequest, run_session
    from executor.tasks import load_tasks
    from harnesses.command import CommandHarness
    from harnesses.gateway import Gateway
    from harnesses.install import default_cache_root
    from harnesses.testing.scripted_model import ScriptedModel
    from sandboxes.local import LocalSandboxProvider

    tasks_path = _write_tasks(scratch / f"plain-{concurrency}.jsonl", n)
    cfg = load_config(_write_config(scratch, f"plain{concurrency}", tasks_path, ""))
    model = ScriptedModel()
    await model.start()
    gateway = Gateway(model.base_url, None, cfg.gateway, **cfg.model.pins())
    await gateway.start()
    ctx = SessionContext(
        config=cfg,
        provider=(provider := LocalSandboxProvider(scratch / "plain-sb", keep=False)),
        harness=CommandHarness(command=NULL_COMMAND),
        gateway=gateway,
        scripted=model,
        evidence_root=scratch / "plain-evidence",
        cache_root=default_cache_root(),
    )
    gate = asyncio.Semaphore(concurrency)

    rows: list[dict[str, Any]] = []

    async def one(task: Any) -> None:
        async with gate:
            rows.append(await run_session(SessionRequest("plain", task, 0, 1), ctx))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(t) for t in load_tasks(tasks_path)))
    wall = time.perf_counter() - t0
    await provider.aclose()
    await gateway.stop()
    await model.stop()
    return wall, [r["started_at"].timestamp() + r["t_total_s"] for r in rows]


def _steady_rate(ends: list[float]) -> float:
    """Rollouts per second while every slot is busy: those finishing between the 10th and the 90th
    percentile of the end times, over that span. The first tenth ends while workers still start (Ray's
    actors come up one after another), the last while the final wave drains with slots idle; a run of
    100,000 rollouts is neither, so both are left out."""
    ends = sorted(ends)
    lo, hi = len(ends) // 10, len(ends) - 1 - len(ends) // 10
    return (hi - lo) / (ends[hi] - ends[lo]) if hi > lo and ends[hi] > ends[lo] else 0.0


def _end_to_end_rate(ends: list[float]) -> float:
    """Rollouts per second between the first and the last to finish: Ray's start-up left out, the
    first ramp and the drain kept."""
    ends = sorted(ends)
    return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else 0.0


def throughput(n: int, levels: tuple[int, ...], scratch: Path) -> list[dict[str, Any]]:
    results = []
    for c in levels:
        tasks = _write_tasks(scratch / f"b{c}.jsonl", n)
        workers = 2
        extra = (
            f"run_id: b{c}\nharness: {{name: command, command: {NULL_COMMAND!r}}}\n"
            f"concurrency: {{workers: {workers}, sessions_per_worker: {c // workers}}}\n"
        )
        summary, wall = _run_driver(_write_config(scratch, f"b{c}", tasks, extra))
        from executor.store import read_table

        cols = read_table(Path(summary.run_dir), ["started_at", "t_total_s"]).to_pydict()
        ends = [s.timestamp() + t for s, t in zip(cols["started_at"], cols["t_total_s"], strict=True)]
        plain_wall, plain_ends = asyncio.run(_plain_runner(n, c, scratch))
        steady, plain_steady = _steady_rate(ends), _steady_rate(plain_ends)
        results.append(
            {
                "concurrency": c,
                "rollouts": n,
                "executor_per_s": n / wall,
                "plain_per_s": n / plain_wall,
                "executor_steady_per_s": steady,
                "plain_steady_per_s": plain_steady,
                "ratio": steady / plain_steady if plain_steady else 0.0,
                "executor_end_to_end_per_s": _end_to_end_rate(ends),
                "plain_end_to_end_per_s": _end_to_end_rate(plain_ends),
                "executor_final": summary.final,
            }
        )
    return results


# (c) ------------------------------------------------------------------------------------------------


def _null_worker_class(token_ids: int = 0) -> Any:
    """``token_ids``: each row carries two model calls with that many prompt and completion ids and
    logprobs, as a run with ``gateway.capture_tokens`` does."""
    import ray

    from executor.row import ModelCall, Row
    from executor.schema import batch_to_wire, rows_to_batch

    class NullWorker:
        """Answers every session at once with a completed row: only the driver's side is exercised."""

        def __init__(self, config_json: str, run_dir: str, worker_index: int) -> None:
            self.run_id = json.loads(config_json)["run_id"]
            ids = list(range(token_ids))
            self.calls = [
                ModelCall(
                    request_index=i,
                    status=200,
                    kind="none",
                    prompt_token_ids=ids,
                    completion_token_ids=ids,
                    completion_logprobs=[-0.5] * token_ids,
                )
                for i in range(2 if token_ids else 0)
            ]

        async def run(
            self, task_json: str, sample_index: int, attempt: int, policy: str | None = None
        ) -> Any:
            task_id = json.loads(task_json)["id"]
            row = Row(
                run_id=self.run_id,
                rollout_id=f"{task_id}.s{sample_index}.a{attempt}",
                task_id=task_id,
                sample_index=sample_index,
                attempt=attempt,
                harness="null",
                sandbox_provider="null",
                status="completed",
                failure_kind="none",
                reward=1.0,
                final_text="done",
                model_calls=self.calls,
            )
            return batch_to_wire(rows_to_batch([row.to_dict()]))

    return ray.remote(NullWorker)


def driver_memory_child(n: int, scratch: Path, token_ids: int = 0) -> dict[str, Any]:
    """Run in a fresh process: one driver, n null rollouts; report its peak RSS."""
    name = f"c{n}t{token_ids}"
    tasks = _write_tasks(scratch / f"{name}.jsonl", n)
    extra = (
        f"run_id: {name}\nharness: {{name: command}}\nconcurrency: {{workers: 2, sessions_per_worker: 128}}\n"
    )
    cfg = _write_config(scratch, name, tasks, extra)
    summary, wall = _run_driver(cfg, _null_worker_class(token_ids))
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "rollouts": n,
        "token_ids": token_ids,
        "final": summary.final,
        "wall_s": wall,
        "peak_rss_mb": peak_kb / 1024,
    }


def driver_memory(n: int, scratch: Path, token_ids: int = 0) -> list[dict[str, Any]]:
    results = []
    for size in (n, 10 * n):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "executor.testing.bench",
                "memory-child",
                str(size),
                str(scratch),
                str(token_ids),
            ],
            capture_output=True,
            text=True,
            timeout=7200,
            cwd=Path(__file__).parents[1],
        )
        if out.returncode != 0:
            raise RuntimeError(f"memory run of {size} failed: {out.stderr[-2000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


# (d) ------------------------------------------------------------------------------------------------


def store(rows: int, scratch: Path, where: str | None = None) -> dict[str, Any]:
    """``where``: a URI (an object store's, e.g.) to write the rows under, in a directory of its own that
    is removed after; by default the local scratch directory."""
    from executor.row import Message, Row, ToolCall
    from executor.schema import rows_to_batch
    from executor.store import RunStore, scan

    def row(i: int) -> dict[str, Any]:
        return Row(
            run_id="d",
            rollout_id=f"t{i}.s0.a1",
            task_id=f"t{i}",
            sample_index=0,
            attempt=1,
            status="completed",
            failure_kind="none",
            decision="accept",
            final=True,
            masked=False,
            reward=1.0,
            final_text="done " * 40,
            tool_calls=[ToolCall(name="shell", status="completed", exit_code=0, output="ok\n")],
            messages=[Message(role="assistant", text="x" * 400)],
        ).to_dict()

    batches = [
        rows_to_batch([row(i) for i in range(start, min(start + 100, rows))]) for start in range(0, rows, 100)
    ]
    from executor.storage import locate

    base = locate(where) / f"bench-d-{uuid.uuid4().hex[:8]}" if where else locate(scratch)
    st = RunStore(base / "d", flush_rows=10_000)
    try:
        t0 = time.perf_counter()
        for batch in batches:
            st.append(batch)
        st.flush()
        append_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        state = scan(base / "d" / "rows")
        scan_s = time.perf_counter() - t0
    finally:
        if where:
            base.fs.delete_dir(base.path)
    assert len(state.final) == rows
    return {
        "rows": rows,
        "store": base.uri if where else "local disk",
        "append_rows_per_s": rows / append_s,
        "resume_scan_s": scan_s,
    }


# (e) ------------------------------------------------------------------------------------------------

# The phases in the order a run passes them; "spawned" is 0 by definition.
PHASES = (
    "cli",
    "config",
    "ray_up",
    "preflight",
    "harness",
    "workers_created",
    "first_worker_ready",
    "first_row",
    "last_row",
    "summary",
    "exit",
)


def _one_run(config: Path, run_id: str, sandboxes: Path, env: dict[str, str]) -> dict[str, float]:
    """One `rollout run` in a fresh process: each phase's time after the spawn, and what it left."""
    from executor.store import read_table
    from sandboxes.testing.leaks import processes_under

    argv = [sys.executable, "-m", "executor", "run", str(config), "--run-id", run_id]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    spawned = time.monotonic()
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2], env=env
    )
    exited = time.monotonic()
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_dir = config.parent / "out" / run_id
    if proc.returncode != 0:
        raise RuntimeError(f"run {run_id} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    rows = read_table(run_dir, ["reward"]).to_pydict()["reward"]
    if any(r != 1.0 for r in rows):
        raise RuntimeError(f"run {run_id} did not solve every task: {rows}")
    marks = json.loads((run_dir / "summary.json").read_text()).get("phases", {})
    origin = marks.pop("origin_monotonic", None)
    out = {name: origin + at - spawned for name, at in marks.items()} if origin is not None else {}
    out["exit"] = exited - spawned
    # The command's CPU (with the Ray processes it started and reaped; not a warm executor's): on a
    # loaded machine, steadier than its wall time.
    out["cpu_s"] = sum(getattr(cpu_after, f) - getattr(cpu_before, f) for f in ("ru_utime", "ru_stime"))
    out["left_sandbox_processes"] = float(len(processes_under(str(sandboxes))))
    return out


def _rollout(env: dict[str, str], *args: str) -> None:
    argv = [sys.executable, "-m", "executor", *args]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2], env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"rollout {args[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")


def _medians(timings: list[dict[str, float]]) -> dict[str, float]:
    return {
        name: statistics.median(t[name] for t in timings)
        for name in (*PHASES, "cpu_s", "left_sandbox_processes")
        if all(name in t for t in timings)
    }


def fixed_costs(rollouts: int, runs: int, concurrency: int, scratch: Path) -> dict[str, Any]:
    """``runs`` cold runs of ``rollouts`` one-tool Codex rollouts, each followed by one attached to a warm
    executor (`rollout up`) and by the same rollouts by hand; the median of each phase's time."""
    from harnesses.codex import CodexHarness
    from harnesses.install import default_cache_root

    tasks = _write_tasks(scratch / "e.jsonl", rollouts, model_script=SCRIPT, verify=VERIFY)
    extra = f"concurrency: {{workers: 1, sessions_per_worker: {concurrency}}}\n"
    config = _write_config(scratch, "e", tasks, extra)
    cold_env = {**os.environ, "ROLLOUT_WARM_DIR": str(scratch / "no-warm")}
    warm_env = {**os.environ, "ROLLOUT_WARM_DIR": str(scratch / "warm")}
    codex_js = (
        CodexHarness().ensure_installed(default_cache_root()) / "node_modules/@openai/codex/bin/codex.js"
    )
    cold: list[dict[str, float]] = []
    warm: list[dict[str, float]] = []
    by_hand: list[float] = []
    _rollout(warm_env, "up", str(config), "--idle-timeout", "900")
    model = _ModelThread()
    try:
        # Interleaved, so the VM's drift hits all three alike.
        for i in range(runs):
            cold.append(_one_run(config, f"e{i}", scratch / "sb", cold_env))
            warm.append(_one_run(config, f"w{i}", scratch / "sb", warm_env))
            t0 = time.perf_counter()
            _direct_runs(range(i * rollouts, (i + 1) * rollouts), model, codex_js, scratch, [], [])
            by_hand.append(time.perf_counter() - t0)
    finally:
        model.stop()
        _rollout(warm_env, "down")
    return {
        "rollouts": rollouts,
        "runs": runs,
        "concurrency": concurrency,
        "median_s": _medians(cold),
        "warm_median_s": _medians(warm),
        "by_hand_median_s": statistics.median(by_hand),
        "all": cold,
        "all_warm": warm,
    }


# A run handed to the warm executor's pre-imported driver (executor/driver_server.py) is a child of that
# server, not of the command: its CPU is not the command's.
WARM_CPU_NOTE = "; its driver, forked by the warm executor, not counted"


def _phase_line(e: dict[str, Any]) -> str:
    # In the order they fell: phases that run side by side (the harness check, Ray's start) may swap.
    left = max(m.get("left_sandbox_processes", 0) for m in (e["median_s"], e["warm_median_s"]))

    def marks(medians: dict[str, float], whose: str = "") -> str:
        order = sorted((n for n in PHASES if n in medians), key=medians.__getitem__)
        cpu = f" (the command's CPU {medians['cpu_s']:.2f} s{whose})" if "cpu_s" in medians else ""
        return ", ".join(f"{n} {medians[n]:.2f}" for n in order) + cpu

    return (
        f"(e) fixed costs, {e['runs']} `rollout run`s of {e['rollouts']} one-tool Codex rollouts at "
        f"concurrency {e['concurrency']}, each in a fresh process; median seconds after the spawn: "
        f"cold {marks(e['median_s'])}; attached to a warm executor "
        f"{marks(e['warm_median_s'], WARM_CPU_NOTE)}; "
        f"the same rollouts by hand {e['by_hand_median_s']:.2f} s; sandbox processes left "
        f"{left:.0f}"
    )


# ----------------------------------------------------------------------------------------------------


def run_all(
    parts: str,
    runs: int,
    null_rollouts: int,
    memory_rollouts: int,
    store_rows: int,
    echo: Callable[[str], None] = print,
    token_ids: int = 0,
    cold_runs: int = 5,
    cold_rollouts: int = 10,
    cold_concurrency: int = 1,
    container: Any = None,
    scale: tuple[int, int, float] = (1000, 8, 30.0),
    isolation: str | None = None,
    store_out: str | None = None,
) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="rollout-bench-", dir=str(Path.home())))
    out: dict[str, Any] = {}
    try:
        if "d" in parts:
            out["d"] = d = store(store_rows, scratch, store_out)
            echo(
                f"(d) store ({d['store']}): {d['append_rows_per_s']:,.0f} rows/s appended; "
                f"resume scan of {d['rows']:,} rows {d['resume_scan_s']:.2f} s"
            )
        if "a" in parts:
            out["a"] = a = overhead(runs, scratch, container, isolation)
            echo(
                f"(a) overhead, {runs} sequential Codex rollouts: "
                f"direct median {a['direct_median_s']:.3f} s (codex exec alone "
                f"{a['direct_codex_only_median_s']:.3f} s), "
                f"executor median {a['executor_session_median_s']:.3f} s (phases: setup "
                f"{a['executor_setup_phase_median_s']:.3f}, harness "
                f"{a['executor_harness_phase_median_s']:.3f}, verify "
                f"{a['executor_verify_phase_median_s']:.3f}, cleanup "
                f"{a['executor_cleanup_phase_median_s']:.3f} s), ratio {a['ratio']:.2f} "
                f"(median of the pairs' ratios {a['pairwise_ratio_median']:.2f})"
            )
        if "b" in parts:
            out["b"] = b = throughput(null_rollouts, (32, 128), scratch)
            for r in b:
                echo(
                    f"(b) null harness at concurrency {r['concurrency']}: "
                    f"executor {r['executor_steady_per_s']:.1f}/s, "
                    f"plain asyncio {r['plain_steady_per_s']:.1f}/s "
                    "(steady state: the 10th to the 90th percentile of ends), "
                    f"ratio {r['ratio']:.2f}; first to last end "
                    f"{r['executor_end_to_end_per_s']:.1f}/s vs {r['plain_end_to_end_per_s']:.1f}/s; "
                    f"with start-up {r['executor_per_s']:.1f}/s vs {r['plain_per_s']:.1f}/s"
                )
        if "c" in parts:
            out["c"] = c = driver_memory(memory_rollouts, scratch, token_ids)
            tokens = f", {token_ids:,} token ids per model call" if token_ids else ""
            echo(
                f"(c) driver peak RSS{tokens}: {c[0]['rollouts']:,} rollouts {c[0]['peak_rss_mb']:.0f} MB, "
                f"{c[1]['rollouts']:,} rollouts {c[1]['peak_rss_mb']:.0f} MB, "
                f"ratio {c[1]['peak_rss_mb'] / c[0]['peak_rss_mb']:.2f}"
            )
        if "e" in parts:
            out["e"] = e = fixed_costs(cold_rollouts, cold_runs, cold_concurrency, scratch)
            echo(_phase_line(e))
        if "g" in parts:
            (scratch / "g").mkdir()
            out["g"] = g = overhead(runs, scratch / "g", container or default_container())
            echo(
                f"(g) overhead in containers ({g['image']}), {runs} sequential Codex rollouts: "
                f"by hand with `podman run --rm` {g['direct_median_s']:.3f} s, "
                f"executor median {g['executor_session_median_s']:.3f} s (phases: setup "
                f"{g['executor_setup_phase_median_s']:.3f}, harness "
                f"{g['executor_harness_phase_median_s']:.3f}, verify "
                f"{g['executor_verify_phase_median_s']:.3f}, cleanup "
                f"{g['executor_cleanup_phase_median_s']:.3f} s), ratio {g['ratio']:.2f} "
                f"(median of the pairs' ratios {g['pairwise_ratio_median']:.2f})"
            )
        if "f" in parts:
            from executor.testing import bench_scale

            out["f"] = f = bench_scale.scale(*scale, scratch)
            echo(bench_scale.line(f))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------------------------------

PHASE_NAMES = {
    "cli": "CLI imported",
    "config": "config read",
    "preflight": "preflight done",
    "harness": "harness install checked",
    "ray_up": "Ray up",
    "workers_created": "worker actors created",
    "first_worker_ready": "first worker ready",
    "first_row": "first row",
    "last_row": "last row",
    "summary": "summary written",
    "exit": "process exited",
}


def markdown(figures: dict[str, Any], command: str, when: str, machine: str) -> str:
    """The figures of one `rollout bench` as the tables of docs/performance.md."""
    lines = [f"Measured {when} on {machine}: `{command}`.", ""]
    lines += ["| comparison | executor | without it | ratio |", "|---|---|---|---|"]
    if a := figures.get("a"):
        lines.append(
            f"| (a) one Codex rollout, sequential, median of {a['runs']} (whole session) "
            f"| {a['executor_session_median_s']:.3f} s | {a['direct_median_s']:.3f} s by hand "
            f"(`codex exec` alone {a['direct_codex_only_median_s']:.3f} s) "
            f"| {a['ratio']:.2f} (median of the pairs' ratios {a['pairwise_ratio_median']:.2f}) |"
        )
    if g := figures.get("g"):
        lines.append(
            f"| (g) the same in a container of `{g['image']}`, median of {g['runs']} "
            f"| {g['executor_session_median_s']:.3f} s | {g['direct_median_s']:.3f} s by hand "
            f"(`podman run --rm` of `codex exec`) "
            f"| {g['ratio']:.2f} (median of the pairs' ratios {g['pairwise_ratio_median']:.2f}) |"
        )
    if (e := figures.get("e")) and "exit" in e.get("warm_median_s", {}):
        warm = e["warm_median_s"]["exit"]
        lines.append(
            f"| (e) {e['rollouts']} one-tool Codex rollouts, the whole `rollout run` attached to a warm "
            f"executor, median of {e['runs']} | {warm:.2f} s | {e['by_hand_median_s']:.2f} s by hand "
            f"| {warm / e['by_hand_median_s']:.2f} |"
        )
    for r in figures.get("b", []):
        lines.append(
            f"| (b) null harness, concurrency {r['concurrency']}, steady state "
            f"| {r['executor_steady_per_s']:.1f} rollouts/s "
            f"| {r['plain_steady_per_s']:.1f}/s (plain asyncio) "
            f"| {r['ratio']:.2f} |"
        )
    if c := figures.get("c"):
        small, large = c
        lines.append(
            f"| (c) driver peak RSS, {small['rollouts']:,} vs {large['rollouts']:,} null rollouts "
            f"| {small['peak_rss_mb']:.0f} MB vs {large['peak_rss_mb']:.0f} MB | "
            f"| {large['peak_rss_mb'] / small['peak_rss_mb']:.2f} |"
        )
    if d := figures.get("d"):
        lines.append(
            f"| (d) Arrow store | {d['append_rows_per_s']:,.0f} rows/s appended; resume scan of "
            f"{d['rows']:,} rows {d['resume_scan_s']:.2f} s | | |"
        )
    for name, part in (("a", a), ("g", g)):
        if part:
            lines += [
                "",
                f"({name}) by phase, medians: setup {part['executor_setup_phase_median_s'] * 1000:.0f} ms, "
                f"harness {part['executor_harness_phase_median_s'] * 1000:.0f} ms (`codex exec` by hand "
                f"{part['direct_codex_only_median_s'] * 1000:.0f} ms), verify "
                f"{part['executor_verify_phase_median_s'] * 1000:.0f} ms, cleanup "
                f"{part['executor_cleanup_phase_median_s'] * 1000:.0f} ms.",
            ]
    if e:
        lines += [
            "",
            f"(e) fixed costs: {e['runs']} `rollout run`s of {e['rollouts']} one-tool Codex rollouts at "
            f"concurrency {e['concurrency']}, each in a fresh process, cold and attached to a warm executor "
            f"(`rollout up`), interleaved; median seconds after the spawn. The same rollouts by hand "
            f"(fresh workspace and config, `codex exec`, the verifier, one after another): "
            f"{e['by_hand_median_s']:.2f} s.",
            "",
            "| phase | cold | warm |",
            "|---|---|---|",
        ]
        cold, warm = e["median_s"], e.get("warm_median_s", {})
        order = sorted((n for n in PHASES if n in cold), key=cold.__getitem__)
        lines += [
            f"| {PHASE_NAMES.get(n, n)} | {cold[n]:.2f} | {warm[n]:.2f} |"
            if n in warm
            else f"| {PHASE_NAMES.get(n, n)} | {cold[n]:.2f} | |"
            for n in order
        ]
        if "cpu_s" in cold and "cpu_s" in warm:
            warm_cpu = f"{warm['cpu_s']:.2f}{WARM_CPU_NOTE}"
            lines.append(f"| the command's CPU (s) | {cold['cpu_s']:.2f} | {warm_cpu} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "memory-child":
        print(json.dumps(driver_memory_child(int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))))
