import json

import pytest

from executor.tasks import InputError, load_tasks


def _write(tmp_path, lines):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_loads_tasks_with_verifier_shorthand(tmp_path):
    path = _write(
        tmp_path,
        [
            json.dumps({"id": "a", "prompt": "p", "verify": "true"}),
            "",
            json.dumps({"id": "b", "prompt": "q", "workspace": {"files": {"x.py": ""}}}),
        ],
    )
    tasks = list(load_tasks(path))
    assert [t.id for t in tasks] == ["a", "b"]
    assert tasks[0].verify.command == "true"
    assert tasks[1].workspace.files == {"x.py": ""}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "tasks.jsonl:2: not valid JSON"),
        ('["a list"]', "tasks.jsonl:2: a task must be a JSON object"),
        ('{"id": "b"}', "tasks.jsonl:2: prompt: Field required"),
        ('{"id": "b", "prompt": "p", "colour": 1}', "tasks.jsonl:2: colour: Extra inputs are not permitted"),
        ('{"id": "a", "prompt": "p"}', "tasks.jsonl:2: duplicate task id 'a'"),
        ('{"id": "../x", "prompt": "p"}', "tasks.jsonl:2: id: Value error"),
        (
            '{"id": "b", "prompt": "p", "prompt": "q"}',
            "tasks.jsonl:2: not valid JSON (key 'prompt' appears twice",
        ),
        (
            '{"id": "b", "prompt": "p", "verify": {"command": "true", "command": "false"}}',
            "key 'command' appears twice",
        ),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, line, message):
    path = _write(tmp_path, [json.dumps({"id": "a", "prompt": "p"}), line])
    with pytest.raises(InputError) as info:
        list(load_tasks(path))
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="task file not found"):
        list(load_tasks(tmp_path / "nope.jsonl"))


def test_parquet_tasks(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "tasks.parquet"
    pq.write_table(
        pa.table({"id": ["a", "b"], "prompt": ["p", "q"], "verify": ['{"command": "true"}', None]}), path
    )
    tasks = list(load_tasks(path))
    assert [t.id for t in tasks] == ["a", "b"]
    assert tasks[0].verify.command == "true" and tasks[1].verify is None


@pytest.mark.parametrize(
    ("verify", "message"),
    [
        ("{not json", "tasks.parquet: row 2: verify: not valid JSON"),
        (
            '{"command": "true", "command": "false"}',
            "row 2: verify: not valid JSON (key 'command' appears twice",
        ),
    ],
)
def test_a_bad_json_column_of_a_parquet_task_names_the_row_and_column(tmp_path, verify, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "tasks.parquet"
    pq.write_table(
        pa.table({"id": ["a", "b"], "prompt": ["p", "q"], "verify": ['{"command": "true"}', verify]}), path
    )
    with pytest.raises(InputError) as info:
        list(load_tasks(path))
    assert message in str(info.value)
    assert "\n" not in str(info.value)
