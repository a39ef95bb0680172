"""Harbor-format tasks, read as they are: ``tasks:`` naming a directory of task directories, each

    instruction.md           the prompt
    task.toml                [agent] timeout_sec, [verifier] timeout_sec, [environment] cpus, memory_mb
                             (or memory = "2G"), docker_image (else the Dockerfile is built)
    environment/Dockerfile   the task's image (its build context: environment/)
    tests/test.sh            the verifier, with whatever else tests/ holds

The verifier contract is Harbor's: after the agent's session every process it left is killed, ``/tests``
and ``/logs/verifier`` are emptied (so nothing the agent planted there counts), ``tests/`` is uploaded to
``/tests``, ``bash /tests/test.sh`` runs under the verifier timeout in the image's working directory, and
the reward is the number in ``/logs/verifier/reward.txt``, or ``reward.json``'s ``reward``. No readable
reward is ``verifier_error`` (masked), never 0. A task directory that lacks one of its files becomes a
task that fails at set-up with one line naming it; the others run.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from executor.task import InputError, Task, Verifier
from policy import FailureKind
from sandboxes.base import Sandbox, SandboxError

TESTS_IN = "/tests"
REWARD_DIR = "/logs/verifier"
REWARD_LIMIT = 64 * 1024
RESET_TIMEOUT_S = 60.0
DEFAULT_TIMEOUT_S = 600.0
# Kills every process in the container but the agent (pid 1) and this script's own ancestors, then
# empties the verifier's directories.
_RESET = """import os, shutil, signal, sys
keep, pid = {1, os.getpid()}, os.getpid()
while pid > 1:
    with open("/proc/%d/stat" % pid) as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
    keep.add(pid)
for entry in os.listdir("/proc"):
    if entry.isdigit() and int(entry) not in keep:
        try:
            os.kill(int(entry), signal.SIGKILL)
        except OSError:
            pass
for path in sys.argv[1:]:
    if os.path.islink(path) or os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
    os.makedirs(path, exist_ok=True)
    # Emptied, not replaced: a command user may own the directory and not its parent.
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        else:
            os.unlink(full)
"""


def is_harbor_dir(path: Path) -> bool:
    return path.is_dir()


def load_harbor_tasks(root: Path) -> Iterator[Task]:
    """One task per subdirectory of ``root`` (sorted), ids from the directory names."""
    entries = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not entries:
        raise InputError(f"{root}: no Harbor task directories in it")
    for task_dir in entries:
        yield _task(task_dir)


def _task(task_dir: Path) -> Task:
    task_id = task_dir.name
    try:
        return _read(task_dir)
    except (OSError, ValueError, tomllib.TOMLDecodeError, InputError) as exc:
        why = " ".join(str(exc).split())[:400]
        # A task that cannot run, recorded as such: a row names it, and the other tasks go on.
        return Task(id=task_id, prompt="(unreadable Harbor task)", invalid=f"Harbor task {task_id}: {why}")


# Every key of task.toml, and what becomes of it: a key not here fails its task at set-up in one line
# naming it. "meta": kept in the task's metadata and no more (it changes nothing Harbor runs).
_KNOWN: dict[str, set[str]] = {
    "": {"version", "schema_version", "task", "metadata", "agent", "verifier", "environment", "solution",
         "source", "artifacts", "steps", "multi_step_reward_strategy"},
    "task": {"name", "description", "authors", "keywords"},
    "agent": {"timeout_sec", "user", "env"},
    "verifier": {"timeout_sec", "env", "user", "environment_mode", "environment"},
    "solution": {"env"},
    "environment": {"build_timeout_sec", "docker_image", "os", "cpus", "memory_mb", "memory", "storage_mb",
                    "storage", "gpus", "gpu_types", "allow_internet", "mcp_servers", "env", "skills_dir",
                    "healthcheck", "workdir"},
}  # fmt: skip
# Harbor's defaults where task.toml is silent (its EnvironmentConfig / VerifierConfig).
HARBOR_CPUS = 1
HARBOR_MEMORY_MB = 2048
HARBOR_BUILD_TIMEOUT_S = 600.0


def _read(task_dir: Path) -> Task:
    for need in ("instruction.md", "task.toml", "tests/test.sh"):
        if not (task_dir / need).is_file():
            raise InputError(f"missing {need}")
    prompt = (task_dir / "instruction.md").read_text(encoding="utf-8")
    if not prompt.strip():
        raise InputError("instruction.md is empty")
    toml: dict[str, Any] = tomllib.loads((task_dir / "task.toml").read_text(encoding="utf-8"))
    _refuse_unknown(toml)
    if (task_dir / "steps").is_dir():
        raise InputError("steps/ (a multi-step task) is not supported by this executor")
    env, agent, verifier = _table(toml, "environment"), _table(toml, "agent"), _table(toml, "verifier")
    _refuse_unsupported(toml, env, verifier)
    image = env.get("docker_image") or None
    if image is None and not (task_dir / "environment" / "Dockerfile").is_file():
        raise InputError("missing environment/Dockerfile (and no [environment] docker_image)")
    memory = _size_mb(env, "memory_mb", "memory")
    return Task(
        id=task_dir.name,
        prompt=prompt,
        deadline_s=_seconds(agent, "agent"),
        verify=Verifier(
            command=f"bash {TESTS_IN}/test.sh",
            timeout_s=_seconds(verifier, "verifier") or DEFAULT_TIMEOUT_S,
            # A run that wrote no reward is run once more as a verifier; the agent is never rerun for it.
            retries=1,
            tests_dir=str((task_dir / "tests").resolve()),
            env=_env(verifier, "verifier"),
            user=_user(verifier, "verifier"),
        ),
        image=image,
        build=None if image else str((task_dir / "environment").resolve()),
        cpus=_number_of(env, "cpus", HARBOR_CPUS),
        memory_mb=HARBOR_MEMORY_MB if memory is None else memory,
        workdir=_workdir(env),
        user=_user(agent, "agent"),
        allow_internet=_flag(env, "allow_internet"),
        env={**_env(env, "environment"), **_env(agent, "agent")},
        build_timeout_s=_number_of(env, "build_timeout_sec", HARBOR_BUILD_TIMEOUT_S),
        storage_mb=_size_mb(env, "storage_mb", "storage"),
        gpus=int(_number_of(env, "gpus", 0)),
        metadata={
            "harbor": {
                "dir": str(task_dir.resolve()),
                "metadata": _table(toml, "metadata"),
                "task": _table(toml, "task"),
                "solution_env": _env(_table(toml, "solution"), "solution"),
            }
        },
    )


def _refuse_unknown(toml: dict[str, Any]) -> None:
    for table, keys in _KNOWN.items():
        value = toml if not table else toml.get(table, {})
        if not isinstance(value, dict):
            raise InputError(f"task.toml: [{table}] is not a table")
        for key in value:
            if key not in keys:
                where = f"[{table}] {key}" if table else key
                raise InputError(f"task.toml: {where} is not a Harbor field this executor knows")


def _refuse_unsupported(toml: dict[str, Any], env: dict[str, Any], verifier: dict[str, Any]) -> None:
    """What Harbor can do and this executor cannot (yet): each refuses the task in one line naming it."""
    refusals = {
        "steps (a multi-step task)": toml.get("steps"),
        "multi_step_reward_strategy": toml.get("multi_step_reward_strategy"),
        "artifacts": toml.get("artifacts"),
        "[environment] mcp_servers": env.get("mcp_servers"),
        "[environment] skills_dir": env.get("skills_dir"),
        "[environment] healthcheck": env.get("healthcheck"),
        "[verifier] environment (a separate verifier image)": verifier.get("environment"),
    }
    for what, value in refusals.items():
        if value:
            raise InputError(f"task.toml: {what} is not supported by this executor")
    if str(env.get("os", "linux")).lower() != "linux":
        raise InputError(f"task.toml: [environment] os {env['os']!r}: only linux tasks run here")
    mode = verifier.get("environment_mode")
    if mode not in (None, "shared"):
        raise InputError(f"task.toml: [verifier] environment_mode {mode!r}: only 'shared' runs here")


def _table(toml: dict[str, Any], name: str) -> dict[str, Any]:
    value = toml.get(name, {})
    if not isinstance(value, dict):
        raise InputError(f"task.toml: [{name}] is not a table")
    return value


def _seconds(table: dict[str, Any], name: str) -> float | None:
    value = table.get("timeout_sec")
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 86_400:
        raise InputError(f"task.toml: [{name}] timeout_sec {value!r} is not a number of seconds")
    return float(value)


def _number_of(table: dict[str, Any], key: str, default: float) -> float:
    value = table.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise InputError(f"task.toml: [environment] {key} {value!r} is not a non-negative number")
    return value


def _flag(table: dict[str, Any], key: str) -> bool:
    value = table.get(key, False)
    if not isinstance(value, bool):
        raise InputError(f"task.toml: [environment] {key} {value!r} is not true or false")
    return value


def _workdir(env: dict[str, Any]) -> str | None:
    value = env.get("workdir")
    if value is not None and (not isinstance(value, str) or not value.startswith("/") or "\0" in value):
        raise InputError(f"task.toml: [environment] workdir {value!r} is not an absolute path")
    return value


def _user(table: dict[str, Any], name: str) -> str | None:
    value = table.get("user")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int) or not str(value).strip():
        raise InputError(f"task.toml: [{name}] user {value!r} is not a user name or id")
    return str(value)


def _env(table: dict[str, Any], name: str) -> dict[str, str]:
    """A table's ``env``, values as strings. Harbor fills ``${VAR}`` from the host's environment; here
    nothing of the worker's environment enters a sandbox (it may hold the API key), so such a value is
    refused in one line."""
    value = table.get("env", {})
    if not isinstance(value, dict):
        raise InputError(f"task.toml: [{name}.env] is not a table")
    out = {}
    for key, item in value.items():
        if isinstance(item, dict | list) or item is None:
            raise InputError(f"task.toml: [{name}.env] {key} is not a string")
        text = str(item).lower() if isinstance(item, bool) else str(item)
        if "${" in text:
            raise InputError(
                f"task.toml: [{name}.env] {key} = {text[:80]!r}: values from the worker's environment "
                "are never passed into a sandbox"
            )
        out[str(key)] = text
    return out


def _size_mb(table: dict[str, Any], mb_key: str, size_key: str) -> int | None:
    """``memory_mb`` / ``storage_mb`` as given, else ``memory`` / ``storage`` in Harbor's forms ("2G",
    "512M", "1.5Gi"), in MiB."""
    if (value := table.get(mb_key)) is not None:
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise InputError(f"task.toml: [environment] {mb_key} {value!r} is not a positive number")
        return int(value)
    value = table.get(size_key)
    if value is None:
        return None
    text = str(value).strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}.get(text[-1:], None)
    try:
        number = float(text[:-1]) * scale if scale else float(text) / 1024 / 1024
    except ValueError:
        number = -1.0
    if not math.isfinite(number) or number <= 0:
        raise InputError(f"task.toml: [environment] {size_key} {value!r} is not a size")
    return max(1, int(number))


LOG_DIRS = ("agent", "verifier", "artifacts")  # under /logs, as Harbor lays them out
AGENT_LOG_DIRS = ("agent", "artifacts")  # what the agent leaves there for its tests
LOGS_KEPT_LIMIT = 16 * 1024 * 1024
# Writes the named directories as an uncompressed tar to stdout, regular files and directories only,
# links never followed, at most LIMIT bytes of content.
_TAR = """import os, sys, tarfile
limit, total = int(sys.argv[1]), 0
with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
    for top in sys.argv[2:]:
        for base, dirs, files in os.walk(top):
            for name in sorted(files):
                path = os.path.join(base, name)
                if os.path.islink(path) or not os.path.isfile(path):
                    continue
                total += os.path.getsize(path)
                if total > limit:
                    sys.exit(3)
                tar.add(path, recursive=False)
"""


async def prepare_agent(sandbox: Sandbox) -> None:
    """/logs/agent, /logs/verifier and /logs/artifacts, empty and the command user's (the agent gives
    what it unpacks to the user), before the agent starts: Harbor's agents and solutions write there."""
    with tempfile.TemporaryDirectory(prefix="rollout-harbor-logs-") as tmp:
        for name in LOG_DIRS:
            Path(tmp, name).mkdir()
        await sandbox.copy_in(Path(tmp), "/logs")
        # Empty, and emptied again before the tests come in: made now, while the agent (root) can, for a
        # verifier that runs as the command user.
        await sandbox.copy_in(Path(tmp, "agent"), TESTS_IN)


async def keep_logs(sandbox: Sandbox, evidence_dir: Path) -> str | None:
    """/logs/agent and /logs/verifier (the tests' own output among it) as evidence, in
    ``evidence_dir``/harbor-logs.tar.gz; why they could not be kept, or None."""
    python = sandbox.python_argv or ["python3"]
    dirs = [f"/logs/{name}" for name in LOG_DIRS]
    try:
        res = await sandbox.exec(
            [*python, "-c", _TAR, str(LOGS_KEPT_LIMIT), *dirs], timeout=RESET_TIMEOUT_S, name="harbor-logs"
        )
        if res.exit_code != 0 or not res.stdout_path:
            return f"harbor_logs_unavailable: exit {res.exit_code}: {res.stderr_tail[-200:]}"
        data = await sandbox.read_file(res.stdout_path, LOGS_KEPT_LIMIT + 1024 * 1024)
        out = evidence_dir / "harbor-logs.tar.gz"
        await asyncio.to_thread(out.write_bytes, gzip.compress(data, compresslevel=3))
    except (SandboxError, OSError) as exc:
        return f"harbor_logs_unavailable: {str(exc)[:200]}"
    return None


def is_harbor(task: Task) -> bool:
    return task.verify is not None and task.verify.tests_dir is not None


def with_reward_key(task: Task, key: str) -> Task:
    """``task`` with its reward.json metric the run's ``reward_key`` (a Harbor task's only)."""
    if not is_harbor(task) or task.verify is None or task.verify.reward_key == key:
        return task
    return task.model_copy(update={"verify": task.verify.model_copy(update={"reward_key": key})})


async def prepare_verifier(sandbox: Sandbox, verify: Verifier) -> str | None:
    """Harbor's steps before its test: strays killed, /tests and /logs/verifier emptied, tests/ uploaded.
    Why it could not be done, or None. Runs in any image: through the sandbox's own python where it
    carries one (a container's, sandboxes/runtime.py), else the image's python3."""
    python = sandbox.python_argv or ["python3"]
    res = await sandbox.exec(
        [*python, "-c", _RESET, TESTS_IN, REWARD_DIR], timeout=RESET_TIMEOUT_S, name="verify-reset"
    )
    if res.exit_code != 0:
        return f"could not empty {TESTS_IN} and {REWARD_DIR} (exit {res.exit_code}): {res.stderr_tail[-300:]}"
    assert verify.tests_dir is not None
    await sandbox.copy_in(Path(verify.tests_dir), TESTS_IN)
    return None


Rewards = dict[str, float]


async def read_reward(
    sandbox: Sandbox, key: str = "reward"
) -> tuple[float | None, Rewards | None, tuple[FailureKind, str] | None]:
    """What test.sh wrote: (the main reward, every metric, None), or (None, None, why not). reward.txt
    holds one number (the metric ``reward``); reward.json an object of metrics, the main one ``key``
    (Harbor's default ``reward``), or one number. Any finite number: Harbor gives no range. Nothing
    written, or nothing readable, is TASK_INVALID: the tests themselves cannot grade, the same for every
    attempt (the verifier's own re-run is the caller's)."""
    for name in ("reward.txt", "reward.json"):
        try:
            data = await sandbox.read_file(f"{REWARD_DIR}/{name}", REWARD_LIMIT)
        except FileNotFoundError:
            continue
        except SandboxError as exc:
            return (
                None,
                None,
                (FailureKind.VERIFIER_ERROR, f"{REWARD_DIR}/{name} unreadable: {str(exc)[:300]}"),
            )
        metrics = _metrics(data, name)
        if metrics is None:
            shown = data[:100].decode("utf-8", "replace")
            return (
                None,
                None,
                (FailureKind.TASK_INVALID, f"{REWARD_DIR}/{name} holds {shown!r}, not a reward"),
            )
        if key not in metrics:
            names = ", ".join(sorted(metrics))[:200]
            why = f"{REWARD_DIR}/{name} has no metric {key!r} (verifier.reward_key); it has: {names}"
            return None, metrics, (FailureKind.TASK_INVALID, why)
        return metrics[key], metrics, None
    return (
        None,
        None,
        (FailureKind.TASK_INVALID, f"the tests wrote no {REWARD_DIR}/reward.txt or reward.json"),
    )


def _metrics(data: bytes, name: str) -> Rewards | None:
    try:
        parsed = json.loads(data) if name.endswith(".json") else data.decode("utf-8").strip()
        if not isinstance(parsed, dict):
            parsed = {"reward": parsed}
        metrics = {str(k): float(v) for k, v in parsed.items() if not isinstance(v, bool)}
    except (ValueError, TypeError, RecursionError):
        return None
    if not metrics or len(metrics) != len(parsed) or not all(map(math.isfinite, metrics.values())):
        return None
    return metrics
