"""harnesses/pi.py with the real Pi (on the cached Node 22): the session scenarios, the prompt, the NeMo pin.

Node and Pi are installed through harnesses.install into the shared cache, so CI pays for them once.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from harnesses.install import default_cache_root
from harnesses.pi import PiHarness
from harnesses.testing.scripted_model import ScriptedModel
from policy import FailureKind
from sandboxes.local import LocalSandbox
from tests.session_scenarios import MODEL, PROMPT_CASES, SCENARIOS, run_direct, run_scenario, user_texts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

NEMO_GYM_VERSION = "0.80.2"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
async def test_session_scenario(tmp_path: Path, pi_installed: Path, scenario: str) -> None:
    row = await run_scenario(tmp_path, PiHarness(), scenario)
    if scenario == "tool_success":
        assert row["harness_version"] == PiHarness.tested_version and row["version_tested"] is True


async def test_nemo_gym_version_runs_tool_success(tmp_path: Path) -> None:
    harness = PiHarness(NEMO_GYM_VERSION)
    harness.ensure_installed(default_cache_root())
    row = await run_scenario(tmp_path, harness, "tool_success")
    assert row["harness_version"] == NEMO_GYM_VERSION and row["version_tested"] is False


@pytest.mark.parametrize("prompt", PROMPT_CASES.values(), ids=PROMPT_CASES.keys())
async def test_prompt_arrives_intact(
    sandbox: LocalSandbox, model: ScriptedModel, pi_installed: Path, prompt: str
) -> None:
    result, report = await run_direct(
        PiHarness(), sandbox, model, pi_installed, prompt, [{"type": "text", "text": "done"}]
    )
    assert result.exit_code == 0, result.stderr_tail
    requests = model.requests("direct")
    assert [r.aux for r in requests] == [False]
    # Pi trims the whitespace around a prompt it reads from stdin; everything else arrives as sent.
    assert user_texts(requests[0].body) == [prompt.strip()]
    assert report.messages[0].role == "user" and report.messages[0].text.startswith(prompt[:1000])
    assert report.final_text == "done"


async def test_config_is_private_and_holds_no_token(
    sandbox: LocalSandbox, model: ScriptedModel, pi_installed: Path
) -> None:
    result, report = await run_direct(
        PiHarness(), sandbox, model, pi_installed, "hi", [{"type": "text", "text": "done"}]
    )
    assert result.exit_code == 0 and report.claimed_failure is None
    agent = Path(sandbox.home) / ".pi" / "agent"
    for name in ("models.json", "settings.json"):
        assert stat.S_IMODE((agent / name).stat().st_mode) == 0o600
        assert "sk-session-token" not in (agent / name).read_text()
    models = json.loads((agent / "models.json").read_text())
    assert models["providers"]["rollout"]["models"][0]["contextWindow"] >= 128_000  # else it compacts a lot
    [request] = model.requests("direct")
    assert request.body["model"] == MODEL
    assert report.native_transcript_path and report.native_transcript_path.endswith(".jsonl")
    assert b'"type":"session"' in await sandbox.read_file(report.native_transcript_path, 4096)


async def test_model_failure_with_exit_code_0_is_claimed(
    sandbox: LocalSandbox, model: ScriptedModel, pi_installed: Path
) -> None:
    """Pi exits 0 when the model failed; the adapter must read the failure from the JSON."""
    result, report = await run_direct(
        PiHarness(), sandbox, model, pi_installed, "hi", [{"type": "error", "status": 401}]
    )
    assert result.exit_code == 0
    assert report.claimed_failure is FailureKind.PROVIDER_AUTH_ERROR, report.claimed_message
    assert report.final_text is None
