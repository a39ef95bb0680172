"""``rollout replay``: run one recorded rollout again, here, and say what came out differently.

Everything comes from the run directory: the resolved config (``config.yaml``), the task (the run's
``tasks.jsonl`` / ``tasks.parquet`` snapshot, which the driver writes beside the config, else the task
file the config names), and the row itself (harness name and version, sample index, attempt). The
session runs in this process through ``executor.session.run_session`` (no Ray), in a local sandbox,
against the run's endpoint, or another one (``--model-url``). Its evidence and row go to
``RUN_DIR/replays/<rollout_id>.<stamp>/``, never among the run's own rows (for a run on an object store,
``./replays/<run_id>/<rollout_id>.<stamp>/`` here: the replay runs here).

Why a task snapshot rather than the task inside every row: a task's workspace can be large, and a row
is written once per attempt (samples x attempts copies); one copy per run is enough for replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.compute as pc
import yaml
from pydantic import ValidationError

from executor.config import RunConfig
from executor.decisions import decide_row
from executor.export import task_files
from executor.session import SessionContext, SessionRequest, run_session
from executor.storage import Location, Where, local_copy, locate
from executor.store import iter_batches
from executor.tasks import InputError, Task, load_tasks
from executor.worker import build_provider, gateway_socket
from harnesses.gateway import Gateway
from harnesses.install import default_cache_root
from harnesses.registry import make_harness
from sandboxes.local_config import LocalSandboxConfig

if TYPE_CHECKING:  # test machinery: loaded below only when the run used it
    from harnesses.testing.scripted_model import ScriptedModel

# What decides "the same": the outcome, the reward and what the agent did. Timings and token counts are
# shown too, but they vary from run to run by nature.
COMPARED = ("status", "failure_kind", "reward", "verified", "tool_calls")
SHOWN = ("decision", "http_status", "model_calls", "input_tokens", "output_tokens", "t_agent_s")


def load_run_config(where: Where, overrides: dict[str, Any] | None = None) -> RunConfig:
    run_dir = locate(where)
    path = run_dir / "config.yaml"
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise InputError(f"{run_dir}: not a run directory (no config.yaml inside)") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML ({str(exc).splitlines()[0][:120]})") from None
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InputError(f"{path}: {where}: {first['msg']}") from None


def find_row(where: Where, rollout_id: str) -> dict[str, Any]:
    run_dir = locate(where)
    for batch in iter_batches(run_dir / "rows"):
        hit = batch.filter(pc.equal(batch.column("rollout_id"), rollout_id))
        if hit.num_rows:
            return hit.to_pylist()[0]
    raise InputError(f"{run_dir}: no row with rollout id {rollout_id!r} (see `rollout status {run_dir}`)")


def find_task(run_dir: Where, task_id: str) -> Task:
    found = task_files(run_dir)
    if not found:
        raise InputError(f"{run_dir}: no task snapshot (tasks.jsonl) and the config's task file is gone")
    for snapshot in reversed(found):  # a task submitted again later is the one its newest rows ran
        with local_copy(snapshot) as path:
            for task in load_tasks(path):
                if task.id == task_id:
                    return task
    raise InputError(f"{found[0]}: no task with id {task_id!r}")


@contextlib.asynccontextmanager
async def replay_context(
    cfg: RunConfig, row: dict[str, Any], evidence_root: Path, run_dir: Location
) -> AsyncIterator[SessionContext]:
    """What a worker would build for this row, but started and stopped around one session."""
    scripted: ScriptedModel | None = None
    if cfg.model.provider == "scripted":
        from harnesses.testing.scripted_model import ScriptedModel

        scripted = ScriptedModel(model_names=(cfg.model.name,))
        await scripted.start()
        upstream, key = scripted.base_url, None
    else:
        upstream, key = cfg.model.base_urls[0], cfg.model.api_key()
    # Here, in a local sandbox isolated as the run's was (the run's own section when it was local): a
    # harness sees the same filesystem, user and network, so what it does compares.
    if not isinstance(cfg.sandbox, LocalSandboxConfig):
        cfg = cfg.model_copy(update={"sandbox": LocalSandboxConfig(root=str(cfg.sandbox.root_dir()))})
    gateway = Gateway(upstream, key, cfg.gateway, **cfg.model.pins())
    await gateway.start(unix_path=gateway_socket(cfg))
    try:
        yield SessionContext(
            config=cfg,
            provider=build_provider(cfg, cfg.sandbox.root_dir(), gateway, run_dir),
            harness=make_harness(
                row["harness"] or cfg.harness.name, row["harness_version"], cfg.harness.command
            ),
            gateway=gateway,
            scripted=scripted,
            evidence_root=evidence_root,
            cache_root=default_cache_root(),
            worker_id="replay",
        )
    finally:
        await gateway.stop()
        if scripted is not None:
            await scripted.stop()


def _tool_calls(row: dict[str, Any]) -> list[tuple[Any, ...]]:
    # Outputs carry sandbox paths, which differ from run to run; what was called, and how it ended, does not.
    return [(t["name"], t["arguments"], t["exit_code"]) for t in row.get("tool_calls") or []]


def _value(row: dict[str, Any], name: str) -> Any:
    if name == "tool_calls":
        return _tool_calls(row)
    if name == "model_calls":
        return len(row.get("model_calls") or [])
    return row.get(name)


@dataclass
class ReplayResult:
    recorded: dict[str, Any]
    replayed: dict[str, Any]
    evidence_dir: Path
    differences: list[str]

    @property
    def same(self) -> bool:
        return not self.differences

    def comparison(self) -> list[tuple[str, Any, Any, bool | None]]:
        """(field, recorded, replayed, same); ``same`` is None for fields shown but not compared."""
        out: list[tuple[str, Any, Any, bool | None]] = []
        for name in COMPARED + SHOWN:
            a, b = _value(self.recorded, name), _value(self.replayed, name)
            out.append((name, a, b, (a == b) if name in COMPARED else None))
        return out


def describe_tool_calls(calls: list[tuple[Any, ...]]) -> str:
    return "; ".join(f"{name}({(args or '')[:60]}) -> {code}" for name, args, code in calls) or "(none)"


async def replay(
    where: Where, rollout_id: str, overrides: dict[str, Any] | None = None, out_dir: Path | None = None
) -> ReplayResult:
    run_dir = locate(where)
    cfg = load_run_config(run_dir, overrides)
    row = find_row(run_dir, rollout_id)
    task = find_task(run_dir, row["task_id"])
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{time.monotonic_ns() % 10_000:04d}"
    # The replay runs here: a run on an object store has its replays here too.
    replays = run_dir.local / "replays" if run_dir.local else Path("replays", run_dir.name).absolute()
    out_dir = out_dir or replays / f"{rollout_id}.{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    # Its own run id: the replay's sandbox never shares a directory with the run's (which may still go).
    req = SessionRequest(f"{cfg.run_id}.replay-{stamp}", task, row["sample_index"], row["attempt"])
    async with replay_context(cfg, row, out_dir / "evidence", run_dir) as ctx:
        replayed = await run_session(req, ctx)
    # The policy's own verdict, so a row it masks compares with a null reward as the recorded one does.
    # A group policy can still have overridden the recorded decision: decision is shown, not compared.
    _, columns = decide_row(
        replayed, row["attempt"], cfg.policy, budget_left=cfg.policy.retry_budget, rng=random.Random(0)
    )
    replayed.update({name: values[0] for name, values in columns.items()})
    (out_dir / "row.json").write_text(json.dumps(replayed, default=str, indent=1))
    differences = [n for n in COMPARED if _value(row, n) != _value(replayed, n)]
    # The row names its launch's directory (``<rollout_id>.<tag>``): never rebuilt from the rollout id.
    return ReplayResult(row, replayed, Path(replayed["evidence_dir"]), differences)


def run_replay(run_dir: Where, rollout_id: str, overrides: dict[str, Any] | None = None) -> ReplayResult:
    if not (locate(run_dir) / "rows").is_dir():
        raise InputError(f"{run_dir}: not a run directory (no rows/ inside)")
    return asyncio.run(replay(run_dir, rollout_id, overrides))
