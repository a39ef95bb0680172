"""Harbor task directories read as Harbor writes them: every task.toml key honoured or refused in one
line naming it (executor/harbor.py); rewards as its tests write them."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.harbor import load_harbor_tasks
from executor.tasks import Task


def task_of(tmp_path: Path, toml: str) -> Task:
    task = tmp_path / "tasks" / "t"
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "environment" / "Dockerfile").write_text("FROM scratch\n")
    (task / "instruction.md").write_text("do it\n")
    (task / "tests" / "test.sh").write_text("exit 0\n")
    (task / "task.toml").write_text(toml)
    return next(load_harbor_tasks(tmp_path / "tasks"))


def test_fields_honoured(tmp_path):
    t = task_of(
        tmp_path,
        """
[agent]
timeout_sec = 30
user = "agent"
env = { A = "1" }
[verifier]
timeout_sec = 40
env = { V = "2" }
user = 1000
[environment]
workdir = "/w"
memory = "2G"
storage = "10G"
cpus = 2
allow_internet = true
build_timeout_sec = 5
env = { E = "3", A = "0" }
[solution.env]
S = "4"
""",
    )
    assert t.invalid is None, t.invalid
    assert (t.deadline_s, t.user, t.workdir, t.memory_mb, t.storage_mb, t.cpus) == (
        30,
        "agent",
        "/w",
        2048,
        10240,
        2,
    )
    assert (t.allow_internet, t.build_timeout_s, t.env) == (True, 5, {"E": "3", "A": "1"})
    assert t.verify is not None and (t.verify.timeout_s, t.verify.env, t.verify.user) == (
        40,
        {"V": "2"},
        "1000",
    )
    assert t.verify.retries == 1  # no reward: the verifier is run again, never the agent
    assert t.metadata["harbor"]["solution_env"] == {"S": "4"}


def test_harbor_defaults(tmp_path):
    t = task_of(tmp_path, "")
    assert (t.cpus, t.memory_mb, t.build_timeout_s, t.allow_internet, t.gpus) == (1, 2048, 600.0, False, 0)


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ("[environment]\nhealthcheck = { command = 'true' }\n", "[environment] healthcheck"),
        ("[environment]\nmcp_servers = [{ name = 'x' }]\n", "[environment] mcp_servers"),
        ("[environment]\nos = 'windows'\n", "[environment] os 'windows'"),
        ("[environment]\nmemory = 'lots'\n", "[environment] memory 'lots'"),
        ("[environment]\nfrobnicate = 1\n", "[environment] frobnicate"),
        ("[verifier]\nenvironment_mode = 'separate'\n", "[verifier] environment_mode 'separate'"),
        ("[verifier.env]\nKEY = '${OPENAI_API_KEY}'\n", "[verifier.env] KEY"),
        ("artifacts = ['/app/x']\n", "artifacts"),
        ("[[steps]]\nname = 'a'\n", "steps"),
    ],
)
def test_fields_refused_in_one_line(tmp_path, toml, named):
    t = task_of(tmp_path, toml)
    assert t.invalid is not None and named in t.invalid and "\n" not in t.invalid, t.invalid
