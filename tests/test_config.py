import pytest

from executor.config import load_config
from executor.tasks import InputError


def _cfg(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_and_relative_paths(tmp_path):
    cfg = load_config(_cfg(tmp_path, "tasks: t.jsonl\n"))
    assert cfg.run_id == "run"
    assert cfg.tasks == str(tmp_path / "t.jsonl")
    assert cfg.harness.name == "codex"
    assert cfg.in_flight_cap == cfg.concurrency.workers * cfg.concurrency.sessions_per_worker


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tasks: t.jsonl\ncolour: red\n", "colour: Extra inputs are not permitted"),
        ("tasks: t.jsonl\nharness: {name: nope}\n", "unknown harness 'nope'"),
        ("tasks: t.jsonl\nsamples: 0\n", "samples: Input should be greater than or equal to 1"),
        ("tasks: t.jsonl\ngateway: {max_attempts_per_requst: 3}\n", "gateway.max_attempts_per_requst"),
        ("tasks: t.jsonl\nmodel: {provider: openai}\n", "model.base_url is required"),
        ("tasks: [unclosed\n", "not valid YAML"),
        ("- a list\n", "must be a mapping"),
        (
            "tasks: t.jsonl\nsamples: 2\nharness: {name: codex}\nsamples: 3\n",
            "line 4: key 'samples' appears twice (first on line 2)",
        ),
        (
            "tasks: t.jsonl\ngateway:\n  backoff_base_s: 1\n  backoff_base_s: 2\n",
            "line 4: key 'backoff_base_s' appears twice (first on line 3)",
        ),
        (
            "tasks: t.jsonl\nharness: {name: codex, name: pi}\n",
            "line 2: key 'name' appears twice (first on line 2)",
        ),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path, text, message):
    with pytest.raises(InputError) as info:
        load_config(_cfg(tmp_path, text))
    assert message in str(info.value)
    assert str(info.value).startswith(str(tmp_path / "run.yaml"))
    assert "\n" not in str(info.value)


def test_a_key_may_override_what_a_yaml_merge_brought_in(tmp_path):
    """Refusing a key written twice must not refuse YAML's own override: a key after a ``<<`` merge."""
    path = _cfg(
        tmp_path,
        "tasks: t.jsonl\ngateway:\n"
        "  <<: {max_attempts_per_request: 2, backoff_base_s: 1}\n"
        "  backoff_base_s: 3\n",
    )
    cfg = load_config(path)
    assert (cfg.gateway.max_attempts_per_request, cfg.gateway.backoff_base_s) == (2, 3)


def test_overrides(tmp_path):
    cfg = load_config(
        _cfg(tmp_path, "tasks: t.jsonl\n"),
        {"model.provider": "openai", "model.base_url": "http://127.0.0.1:1/v1"},
    )
    assert cfg.model.base_url == "http://127.0.0.1:1/v1"


def test_missing_key_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("ROLLOUT_TEST_MISSING_KEY", raising=False)
    cfg = load_config(_cfg(tmp_path, "tasks: t.jsonl\nmodel: {api_key_env: ROLLOUT_TEST_MISSING_KEY}\n"))
    with pytest.raises(InputError, match="ROLLOUT_TEST_MISSING_KEY is not set"):
        cfg.model.api_key()
