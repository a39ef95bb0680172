"""Malformed task files and configs, fuzzed: either valid, or one clear bounded line naming the input;
never another exception, never exit code other than 2 at the CLI, never anything written."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from executor.cli import app
from executor.config import RunConfig, load_config
from executor.tasks import InputError, Task, load_tasks

MAX_LINE = 500
# No example database: nothing is written into the repository; a found case becomes a plain test below.
FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Task-shaped objects: the real keys with values of any type, so validation, not JSON parsing, is fuzzed.
task_like = st.fixed_dictionaries(
    {},
    optional={
        key: json_values
        for key in ("id", "prompt", "model_script", "verify", "workspace", "deadline_s", "extra")
    },
)
task_lines = st.lists(
    st.one_of(
        st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
        json_values.map(json.dumps),
        task_like.map(json.dumps),
    ),
    min_size=1,
    max_size=5,
)
config_like = st.fixed_dictionaries(
    {},
    optional={
        key: json_values
        for key in (
            "samples",
            "harness",
            "model",
            "policy",
            "limits",
            "concurrency",
            "gateway",
            "sandbox",
            "typo",
        )
    },
)


def _assert_one_clear_line(message: str, names: str) -> None:
    assert "\n" not in message and len(message) <= MAX_LINE, message
    assert names in message, message


def _tasks_error(path: Path) -> str | None:
    try:
        tasks = list(load_tasks(path))
    except InputError as exc:
        return str(exc)
    return None if tasks else "empty"


@FUZZ
@given(lines=task_lines)
def test_task_files_are_valid_or_one_clear_error(lines):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tasks.jsonl"
        path.write_text("\n".join(line.replace("\n", " ") for line in lines) + "\n", errors="surrogateescape")
        try:
            tasks = list(load_tasks(path))
        except InputError as exc:
            _assert_one_clear_line(str(exc), str(path))
        else:
            assert all(isinstance(t, Task) for t in tasks)


@FUZZ
@given(body=config_like | st.text(max_size=80))
def test_configs_are_valid_or_one_clear_error(body):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        text = body if isinstance(body, str) else yaml.safe_dump({"tasks": "t.jsonl", **body})
        path.write_text(text)
        try:
            cfg = load_config(path)
        except InputError as exc:
            _assert_one_clear_line(str(exc), str(path))
        else:
            assert isinstance(cfg, RunConfig)


@settings(max_examples=20, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=task_lines, config=config_like)
def test_the_cli_says_one_line_exits_2_and_writes_nothing(lines, config):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tasks = root / "tasks.jsonl"
        tasks.write_text(
            "\n".join(line.replace("\n", " ") for line in lines) + "\n", errors="surrogateescape"
        )
        cfg_path = root / "run.yaml"
        cfg_path.write_text(yaml.safe_dump({**config, "tasks": str(tasks), "out": str(root / "out")}))
        config_error = None
        try:
            load_config(cfg_path)
        except InputError as exc:
            config_error = str(exc)
        # Only malformed input here: a valid pair would start a real run.
        assume(config_error is not None or _tasks_error(tasks) is not None)
        result = CliRunner().invoke(app, ["run", str(cfg_path)])
        assert result.exit_code == 2, (result.output, result.exception)
        lines_out = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines_out) == 1 and lines_out[0].startswith("error:"), result.output
        assert not (root / "out").exists()


def _subprocess_rollout(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[1])},
    )


def test_binary_garbage_task_file_through_the_real_cli(tmp_path):
    (tmp_path / "tasks.jsonl").write_bytes(b'\xff\xfe\x00garbage\x80\n{"id": 1}\n')
    (tmp_path / "run.yaml").write_text("tasks: tasks.jsonl\nout: out\n")
    proc = _subprocess_rollout("run", "run.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "tasks.jsonl:1" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_config_that_is_a_yaml_list_through_the_real_cli(tmp_path):
    (tmp_path / "run.yaml").write_text("- tasks: a\n- out: b\n")
    proc = _subprocess_rollout("run", "run.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "run.yaml" in lines[0] and "mapping" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_a_key_with_a_control_character_or_a_huge_value_still_gives_one_bounded_line(tmp_path):
    # Found by the fuzzer: str.splitlines breaks on \x1e, so an echoed key split the error in two.
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"tasks": "t.jsonl", "harness": {"\x1e" + "k" * 5000: 1}}))
    try:
        load_config(path)
    except InputError as exc:
        _assert_one_clear_line(str(exc), str(path))
        assert "\\x1e" in str(exc)
    else:
        raise AssertionError("an unknown key was accepted")
    tasks = tmp_path / "tasks.jsonl"
    long_id = "x" * 200  # the longest id a task may have
    tasks.write_text(
        json.dumps({"id": long_id, "prompt": "p"}) + "\n" + json.dumps({"id": long_id, "prompt": "p"})
    )
    try:
        list(load_tasks(tasks))
    except InputError as exc:
        _assert_one_clear_line(str(exc), f"{tasks}:2")
    else:
        raise AssertionError("a duplicate id was accepted")
