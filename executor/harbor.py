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

import json
import math
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from executor.tasks import InputError, Task, Verifier
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
    if os.path.lexists(path) and not os.path.isdir(path) or os.path.islink(path):
        os.unlink(path)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
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


def _read(task_dir: Path) -> Task:
    for need in ("instruction.md", "task.toml", "tests/test.sh"):
        if not (task_dir / need).is_file():
            raise InputError(f"missing {need}")
    prompt = (task_dir / "instruction.md").read_text(encoding="utf-8")
    if not prompt.strip():
        raise InputError("instruction.md is empty")
    toml: dict[str, Any] = tomllib.loads((task_dir / "task.toml").read_text(encoding="utf-8"))
    env = _table(toml, "environment")
    image = env.get("docker_image") or None
    if image is None and not (task_dir / "environment" / "Dockerfile").is_file():
        raise InputError("missing environment/Dockerfile (and no [environment] docker_image)")
    return Task(
        id=task_dir.name,
        prompt=prompt,
        deadline_s=_seconds(_table(toml, "agent"), "agent"),
        verify=Verifier(
            command=f"bash {TESTS_IN}/test.sh",
            timeout_s=_seconds(_table(toml, "verifier"), "verifier") or DEFAULT_TIMEOUT_S,
            retries=0,
            tests_dir=str((task_dir / "tests").resolve()),
        ),
        image=image,
        build=None if image else str((task_dir / "environment").resolve()),
        cpus=env.get("cpus"),
        memory_mb=env.get("memory_mb") or _megabytes(env.get("memory")),
        metadata={"harbor": {"dir": str(task_dir.resolve()), "metadata": _table(toml, "metadata")}},
    )


def _table(toml: dict[str, Any], name: str) -> dict[str, Any]:
    value = toml.get(name, {})
    if not isinstance(value, dict):
        raise InputError(f"task.toml: [{name}] is not a table")
    return value


def _seconds(table: dict[str, Any], name: str) -> float | None:
    value = table.get("timeout_sec")
    if value is None:
        return None
    if not isinstance(value, int | float) or not 0 < value <= 86_400:
        raise InputError(f"task.toml: [{name}] timeout_sec {value!r} is not a number of seconds")
    return float(value)


def _megabytes(value: Any) -> int | None:
    if value is None:
        return None
    text = str(value).strip().upper().removesuffix("B")
    scale = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}.get(text[-1:], None)
    try:
        return int(float(text[:-1]) * scale) if scale else int(float(text) / 1024 / 1024)
    except ValueError:
        raise InputError(f"task.toml: [environment] memory {value!r} is not a size") from None


async def prepare_verifier(sandbox: Sandbox, verify: Verifier) -> str | None:
    """Harbor's steps before its test: strays killed, /tests and /logs/verifier emptied, tests/ uploaded.
    Why it could not be done, or None."""
    copy_in = getattr(sandbox, "copy_in", None)
    if copy_in is None:
        return f"sandbox {sandbox.id} cannot take the task's tests/ in"
    res = await sandbox.exec(
        ["python3", "-c", _RESET, TESTS_IN, REWARD_DIR], timeout=RESET_TIMEOUT_S, name="verify-reset"
    )
    if res.exit_code != 0:
        return f"could not empty {TESTS_IN} and {REWARD_DIR} (exit {res.exit_code}): {res.stderr_tail[-300:]}"
    assert verify.tests_dir is not None
    await copy_in(Path(verify.tests_dir), TESTS_IN)
    return None


async def read_reward(sandbox: Sandbox) -> tuple[float | None, tuple[FailureKind, str] | None]:
    """The reward test.sh wrote, from reward.txt, else reward.json; none is a verifier error."""
    for name in ("reward.txt", "reward.json"):
        try:
            data = await sandbox.read_file(f"{REWARD_DIR}/{name}", REWARD_LIMIT)
        except FileNotFoundError:
            continue
        except SandboxError as exc:
            return None, (FailureKind.VERIFIER_ERROR, f"{REWARD_DIR}/{name} unreadable: {str(exc)[:300]}")
        value = _number(data, name)
        if value is None:
            shown = data[:100].decode("utf-8", "replace")
            return None, (FailureKind.VERIFIER_ERROR, f"{REWARD_DIR}/{name} holds {shown!r}, not a reward")
        return value, None
    return None, (FailureKind.VERIFIER_ERROR, f"the tests wrote no {REWARD_DIR}/reward.txt or reward.json")


def _number(data: bytes, name: str) -> float | None:
    try:
        if name.endswith(".json"):
            parsed = json.loads(data)
            parsed = parsed.get("reward") if isinstance(parsed, dict) else parsed
        else:
            parsed = data.decode("utf-8").strip()
        value = float(parsed)
    except (ValueError, TypeError):
        return None
    return value if math.isfinite(value) else None
