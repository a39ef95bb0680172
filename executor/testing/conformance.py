"""``rollout conformance``: every scenario against every harness, through the real executor path.

One cell is one (harness, version, scenario). It gets its own scripted model, gateway, sandbox root and
evidence directory, runs ``run_session`` attempt after attempt (as the driver would resubmit) until the
driver's own decision function says the row is final, stores each row through the Arrow schema into the
cell's run directory, reads the rows back and hands them to the scenario's checks. The matrix goes to
``conformance.md`` and ``conformance.json``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from executor.config import RunConfig
from executor.decisions import decide_row
from executor.input_text import load_yaml
from executor.schema import rows_to_batch, with_decisions
from executor.session import SessionContext, SessionRequest, run_session
from executor.storage import locate
from executor.store import RunStore, read_table
from executor.tasks import InputError, Task
from executor.worker import build_provider, gateway_socket
from harnesses.base import Harness, Launch, LaunchContext
from harnesses.gateway import Gateway
from harnesses.install import default_cache_root
from harnesses.registry import HARNESSES, make_harness
from harnesses.testing.conformance import (
    NEMO_GYM_VERSIONS,
    PROMPT,
    SCENARIOS,
    SCENARIOS_BY_NAME,
    CheckContext,
    CheckResult,
    Scenario,
    agent_harnesses,
    check_cell,
    merged_config,
)
from harnesses.testing.scripted_model import ScriptedModel
from policy import Decision
from sandboxes import netns
from sandboxes.base import Sandbox, SandboxProvider
from sandboxes.container import ContainerSandboxConfig, list_containers
from sandboxes.local_config import LocalSandboxConfig
from sandboxes.testing.leaks import processes_under

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 4
MAX_ATTEMPTS_PER_CELL = 10  # above every rule the matrix uses; a guard against a policy that never ends
MAX_RETRY_WAIT_S = 10.0
MAX_ERROR_CHARS = 1_000
MAX_OUTAGE_S = 3_600.0  # a scenario whose endpoint refuses everything: longer than any cell
LEAK_WAIT_S = 10.0


@dataclass(frozen=True)
class Target:
    """A harness at a version; ``version`` None means the adapter's tested pin."""

    harness: str
    version: str | None = None

    @property
    def label(self) -> str:
        return f"{self.harness}@{self.version}" if self.version else self.harness


@dataclass
class Cell:
    harness: str
    version: str
    scenario: str
    passed: bool
    checks: list[CheckResult]
    attempts: int
    status: str | None
    failure_kind: str | None
    decisions: list[str]
    reward: float | None
    wall_s: float
    run_dir: str
    error: str | None = None

    @property
    def first_failure(self) -> str | None:
        if self.error:
            return f"runner: {self.error}"
        failed = next((c for c in self.checks if not c.passed), None)
        return f"{failed.name}: {failed.reason}" if failed else None


@dataclass
class Matrix:
    targets: list[str]
    scenarios: list[str]
    cells: list[Cell] = field(default_factory=list)
    wall_s: float = 0.0
    started_at: str = ""
    network: str = "host"  # "isolated": every command of every cell ran in a loopback-only namespace

    @property
    def passed(self) -> bool:
        return bool(self.cells) and all(c.passed for c in self.cells)


def parse_targets(harness: str, versions: Sequence[str]) -> list[Target]:
    """``--harness NAME|all`` and ``--version V`` (one harness), ``--version NAME=V`` (any number) or
    ``--version nemo-gym`` (the versions NeMo Gym validated, for the harnesses that have one)."""
    names = agent_harnesses(list(HARNESSES)) if harness == "all" else [harness]
    for name in names:
        if name not in HARNESSES:
            raise InputError(
                f"--harness: unknown harness {name!r}; known: {', '.join(sorted(HARNESSES))}, all"
            )
    pinned: dict[str, str] = {}
    if list(versions) == ["nemo-gym"]:
        return [Target(name, NEMO_GYM_VERSIONS[name]) for name in names if name in NEMO_GYM_VERSIONS]
    for value in versions:
        name, sep, version = value.rpartition("=")
        if not sep:
            if harness == "all" or len(names) != 1:
                raise InputError(f"--version {value!r}: with several harnesses, say which: NAME=VERSION")
            name = names[0]
        if name not in names:
            raise InputError(f"--version {value!r}: harness {name!r} is not in this run ({', '.join(names)})")
        if not version.strip():
            raise InputError(f"--version {value!r}: empty version")
        pinned[name] = version.strip()
    return [Target(name, pinned.get(name)) for name in names]


def parse_scenarios(names: Sequence[str]) -> list[Scenario]:
    if not names:
        return list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS_BY_NAME]
    if unknown:
        raise InputError(
            f"--scenario: unknown scenario {unknown[0]!r}; known: {', '.join(SCENARIOS_BY_NAME)}"
        )
    return [SCENARIOS_BY_NAME[n] for n in dict.fromkeys(names)]


# ---------------------------------------------------------------------------------------------------------
# One cell


def _config(target: Target, scenario: Scenario, cell_dir: Path) -> RunConfig:
    data = merged_config(scenario)
    data.update(
        run_id=f"conformance-{scenario.name}",
        tasks=str(cell_dir / "tasks.jsonl"),  # never read: the task is built here
        out=str(cell_dir.parent),
        harness={"name": target.harness, "version": target.version},
    )
    return RunConfig.model_validate(data)


def _task(scenario: Scenario) -> Task:
    return Task(
        id=scenario.name,
        prompt=PROMPT,
        model_script=scenario.script,
        verify=scenario.verify,  # type: ignore[arg-type]  # the validator takes the shorthand
        deadline_s=scenario.deadline_s,
    )


class _LaunchInstead:
    """The harness prepared as usual (config written, install found), with ``argv`` run in its place: the
    adapter's parse and the classification then meet a harness that never reached the model."""

    def __init__(self, harness: Harness, argv: tuple[str, ...]) -> None:
        self._harness, self._argv = harness, list(argv)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._harness, name)

    async def prepare(self, sandbox: Sandbox, ctx: LaunchContext) -> Launch:
        launch = await self._harness.prepare(sandbox, ctx)
        return launch.model_copy(update={"argv": self._argv, "stdin": None})


async def _wait_no_processes(marker: str) -> tuple[str, ...]:
    """The sandbox's processes are gone (bounded wait: a killed tree takes a moment to be reaped)."""
    deadline = time.monotonic() + LEAK_WAIT_S
    while (left := await asyncio.to_thread(processes_under, marker)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return tuple(left)


async def run_cell(
    target: Target,
    scenario: Scenario,
    out: Path,
    cache_root: Path,
    *,
    isolated: bool = False,
    container: ContainerSandboxConfig | None = None,
) -> Cell:
    """One cell, its sandboxes local ones, or with ``container`` containers of its image (which reach the
    gateway through its Unix socket, as isolated local ones do). The provider is built as a worker builds
    it (``executor.worker.build_provider``): local sandboxes get the run's isolation (the filesystem view,
    the sandbox user, the run directory hidden), and ``isolated`` only says whether their network is."""
    harness = make_harness(target.harness, target.version)
    cell_dir = out / "cells" / f"{target.harness}@{harness.version}" / scenario.name
    sandbox_root = cell_dir / "sandboxes"
    section: LocalSandboxConfig | ContainerSandboxConfig = (
        container.model_copy(update={"root": str(sandbox_root)})
        if container is not None
        else LocalSandboxConfig(root=str(sandbox_root), network=None if isolated else "host")
    )
    cfg = _config(target, scenario, cell_dir).model_copy(update={"sandbox": section})
    run_dir = cell_dir / (cfg.run_id or "")
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    error: str | None = None
    leftover: tuple[str, ...] = ()
    try:
        # A cell starts clean: rows or sandboxes of an earlier matrix in the same --out must not mix in.
        await asyncio.to_thread(shutil.rmtree, cell_dir, True)
        served = scenario.served_models
        scripted = ScriptedModel(model_names=served or (cfg.model.name,), refuse_unknown_models=bool(served))
        await scripted.start()
        if scenario.endpoint_refuses is not None:
            scripted.outage(MAX_OUTAGE_S, scenario.endpoint_refuses)
        gateway = Gateway(scripted.base_url, None, cfg.gateway, **cfg.model.pins())
        provider: SandboxProvider | None = None
        try:
            await gateway.start(unix_path=gateway_socket(cfg))  # a short path of its own, if any
            provider = build_provider(cfg, sandbox_root, gateway, locate(run_dir))
            ctx = SessionContext(
                config=cfg,
                provider=provider,
                harness=_LaunchInstead(harness, scenario.launch_argv) if scenario.launch_argv else harness,
                gateway=gateway,
                scripted=scripted,
                evidence_root=run_dir / "evidence",
                cache_root=cache_root,
                worker_id="conformance",
            )
            rows = await _play(scenario, cfg, ctx, run_dir)
        finally:
            if (close := getattr(provider, "aclose", None)) is not None:
                await close()  # its spare supervisor server, its directories' deletions
            await gateway.stop()
            await scripted.stop()
        leftover = await _wait_no_processes(str(sandbox_root))
        if container is not None:
            root = str(sandbox_root.resolve())
            left = await asyncio.to_thread(list_containers, container.engine, cfg.run_id)
            leftover += tuple(
                f"container {name}" for name, labels in left if labels.get("rollout.root") == root
            )
    except Exception as exc:
        log.exception("conformance cell %s/%s", target.label, scenario.name)
        error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    checks: list[CheckResult] = []
    if error is None:
        context = CheckContext(cfg.policy, cfg.gateway, cfg.limits.grace_s, leftover)
        checks = check_cell(scenario, rows, context)
    last = rows[-1] if rows else {}
    return Cell(
        harness=target.harness,
        version=harness.version,
        scenario=scenario.name,
        passed=error is None and bool(checks) and all(c.passed for c in checks),
        checks=checks,
        attempts=len(rows),
        status=last.get("status"),
        failure_kind=last.get("failure_kind"),
        decisions=[r.get("decision") or "" for r in rows],
        reward=last.get("reward"),
        wall_s=round(time.monotonic() - started, 2),
        run_dir=str(run_dir),
        error=error,
    )


async def _play(
    scenario: Scenario, cfg: RunConfig, ctx: SessionContext, run_dir: Path
) -> list[dict[str, Any]]:
    """Attempts as the driver makes them: run, decide, store; again after the backoff while it says retry."""
    task, store, rng = _task(scenario), RunStore(run_dir), random.Random(0)
    budget = cfg.policy.retry_budget
    for attempt in range(1, MAX_ATTEMPTS_PER_CELL + 1):
        row = await run_session(SessionRequest(cfg.run_id or "", task, 0, attempt), ctx)
        batch = rows_to_batch([row])
        verdict, decisions = decide_row(
            batch.to_pylist()[0], attempt, cfg.policy, budget_left=budget, rng=rng
        )
        store.append(with_decisions(batch, decisions))
        if verdict.decision is not Decision.RETRY:
            break
        budget -= 1
        await asyncio.sleep(min(verdict.retry_delay_s, MAX_RETRY_WAIT_S))
    store.flush()
    # What is checked is what the store holds, read back through the schema.
    stored = read_table(run_dir).to_pylist()
    return sorted(stored, key=lambda r: r["attempt"])


# ---------------------------------------------------------------------------------------------------------
# The matrix


async def run_matrix(
    targets: Sequence[Target],
    scenarios: Sequence[Scenario],
    out: Path,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    cache_root: Path | None = None,
    network: str = "auto",
    container: ContainerSandboxConfig | None = None,
) -> Matrix:
    """``network``: "isolated" (refuse if this host cannot), "host", or "auto" (isolated when it can).
    ``container``: every cell's sandboxes are containers so configured instead."""
    cache = cache_root or default_cache_root()
    isolated, network_note = network_mode(network)
    if container is not None:
        network_note = f"container ({container.engine}, image {container.image}, --network none)"
    out.mkdir(parents=True, exist_ok=True)
    matrix = Matrix(
        targets=[t.label for t in targets],
        scenarios=[s.name for s in scenarios],
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        network=network_note,
    )
    t0 = time.monotonic()
    # Installs first, one at a time: cells of one harness would otherwise all queue on its install lock.
    install_errors: dict[Target, str] = {}
    for target in targets:
        try:
            await asyncio.to_thread(make_harness(target.harness, target.version).ensure_installed, cache)
        except Exception as exc:
            install_errors[target] = f"adapter or install failed: {type(exc).__name__}: {exc}"[
                :MAX_ERROR_CHARS
            ]
    slots = asyncio.Semaphore(max(1, concurrency))

    async def one(target: Target, scenario: Scenario) -> Cell:
        if target in install_errors:
            return _failed_cell(target, scenario, install_errors[target])
        async with slots:
            return await run_cell(target, scenario, out, cache, isolated=isolated, container=container)

    pairs = [(t, s) for t in targets for s in scenarios]
    # Slow scenarios (the hang, the retried ones) start first, so the quick ones fill in around them.
    slow_first = sorted(range(len(pairs)), key=lambda i: -_weight(pairs[i][1]))
    running = {i: asyncio.ensure_future(one(*pairs[i])) for i in slow_first}
    matrix.cells = list(await asyncio.gather(*(running[i] for i in range(len(pairs)))))
    matrix.wall_s = round(time.monotonic() - t0, 2)
    write_reports(matrix, out)
    return matrix


def network_mode(network: str) -> tuple[bool, str]:
    """Whether cells run isolated, and the matrix's note saying how they ran (and why not, if not)."""
    if network not in ("auto", "isolated", "host"):
        raise InputError(f"--network: {network!r} is not one of auto, isolated, host")
    if network == "host":
        return False, "host (isolation not asked for)"
    try:
        netns.check_available()
    except netns.IsolationUnavailable as exc:
        if network == "isolated":
            raise InputError(f"--network isolated: {exc}") from None
        return False, f"host ({exc})"
    return True, "isolated (each command in a loopback-only network namespace)"


def container_config(provider: str, image: str | None, path: Path | None) -> ContainerSandboxConfig | None:
    """The container section cells run on (``--provider container``), or None for local sandboxes."""
    if provider == "local":
        if image or path:
            raise InputError("--image and --container-config apply to --provider container")
        return None
    if provider != "container":
        raise InputError(f"--provider: {provider!r} is not one of local, container")
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = load_yaml(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise InputError(f"--container-config {path}: {' '.join(str(exc).split())[:200]}") from None
        if not isinstance(data, dict):
            raise InputError(f"--container-config {path}: not a mapping")
    data = {**data, "provider": "container", **({"image": image} if image else {})}
    try:
        config = ContainerSandboxConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InputError(f"--container-config: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if not config.image:
        raise InputError("--provider container needs --image (or image: in --container-config)")
    return config


def _weight(scenario: Scenario) -> float:
    return len(scenario.decisions) * 5 + (scenario.deadline_s or 0)


def _failed_cell(target: Target, scenario: Scenario, error: str) -> Cell:
    return Cell(
        harness=target.harness,
        version=target.version or "(pin)",
        scenario=scenario.name,
        passed=False,
        checks=[],
        attempts=0,
        status=None,
        failure_kind=None,
        decisions=[],
        reward=None,
        wall_s=0.0,
        run_dir="",
        error=error,
    )


def write_reports(matrix: Matrix, out: Path) -> tuple[Path, Path]:
    data = {
        "started_at": matrix.started_at,
        "wall_s": matrix.wall_s,
        "passed": matrix.passed,
        "network": matrix.network,
        "targets": matrix.targets,
        "scenarios": matrix.scenarios,
        "cells": [
            {**asdict(c), "checks": [asdict(r) for r in c.checks], "first_failure": c.first_failure}
            for c in matrix.cells
        ],
    }
    json_path, md_path = out / "conformance.json", out / "conformance.md"
    _write_atomic(json_path, json.dumps(data, indent=1, default=str))
    _write_atomic(md_path, render_markdown(matrix))
    return md_path, json_path


def render_markdown(matrix: Matrix) -> str:
    columns = sorted({(c.harness, c.version) for c in matrix.cells})
    by_key = {(c.harness, c.version, c.scenario): c for c in matrix.cells}
    passed = sum(c.passed for c in matrix.cells)
    lines = [
        "# Conformance matrix",
        "",
        f"{matrix.started_at}; {passed}/{len(matrix.cells)} cells pass; wall {matrix.wall_s:.1f}s; "
        f"network: {matrix.network}.",
        "",
        "| scenario | " + " | ".join(f"{h} {v}" for h, v in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name in matrix.scenarios:
        cells = []
        for h, v in columns:
            cell = by_key.get((h, v, name))
            if cell is None:
                cells.append("-")
            elif cell.passed:
                cells.append(f"pass ({cell.wall_s:.0f}s)")
            else:
                reason = (cell.first_failure or "failed").replace("|", "/").replace("\n", " ")[:160]
                cells.append(f"**FAIL** {reason}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| scenario | the scripted model does | the rows must show |", "|---|---|---|"]
    for name in matrix.scenarios:
        s = SCENARIOS_BY_NAME[name]
        lines.append(f"| {name} | {s.does} | {s.demands} |")
    failures = [c for c in matrix.cells if not c.passed]
    if failures:
        lines += ["", "## Failures", ""]
        for c in failures:
            lines.append(f"- {c.harness} {c.version} / {c.scenario}: {c.first_failure}")
            lines.append(
                f"  (status {c.status}, kind {c.failure_kind}, decisions {c.decisions}, reward {c.reward}; "
                f"rows in {c.run_dir})"
            )
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
