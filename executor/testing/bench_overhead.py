"""`rollout bench` (a) and (g): one Codex rollout at a time through a worker actor, against the same
rollout by hand, locally or in containers of one image (see executor/testing/bench.py).
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from executor.testing.bench_common import (
    SCRIPT,
    VERIFY,
    _direct_runs,
    _median_p90,
    _ModelThread,
    _write_config,
    _write_tasks,
)


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

    class MeasuredWorker(SandboxWorker):
        async def finish_removals(self) -> None:
            """Wait for the last sandbox's deletion (a local one's directory, a container), which runs
            after its row, and for the spares started then (containers): not during the next direct
            run, which must not share the machine with them."""
            provider = self.provider
            if (settle := getattr(provider, "settle", None)) is not None:
                await settle()
            elif (finish := getattr(provider, "finish_removals", None)) is not None:
                await finish()

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
    worker = None
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
        if worker is not None:  # what it holds (a container provider's spares) goes before the cluster
            ray.get(worker.close.remote(), timeout=120)
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
