"""harnesses/opencode.py with the real OpenCode binary: the session scenarios, the prompt, the NeMo pin.

OpenCode is installed through harnesses.install into the shared cache, so CI pays for the download once.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from harnesses.install import default_cache_root
from harnesses.opencode import OpenCodeHarness
from harnesses.testing.scripted_model import ScriptedModel
from sandboxes.local import LocalSandbox
from tests.session_scenarios import MODEL, PROMPT_CASES, SCENARIOS, run_direct, run_scenario, user_texts

# A cap only: OpenCode starts slowly on a loaded 2-core machine (180 s seen for a compaction loop at load 28).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

NEMO_GYM_VERSION = "1.17.11"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
async def test_session_scenario(tmp_path: Path, opencode_installed: Path, scenario: str) -> None:
    row = await run_scenario(tmp_path, OpenCodeHarness(), scenario)
    if scenario == "tool_success":
        assert row["harness_version"] == OpenCodeHarness.tested_version and row["version_tested"] is True


async def test_nemo_gym_version_runs_tool_success(tmp_path: Path) -> None:
    harness = OpenCodeHarness(NEMO_GYM_VERSION)
    harness.ensure_installed(default_cache_root())
    row = await run_scenario(tmp_path, harness, "tool_success")
    assert row["harness_version"] == NEMO_GYM_VERSION and row["version_tested"] is False


@pytest.mark.parametrize("prompt", PROMPT_CASES.values(), ids=PROMPT_CASES.keys())
async def test_prompt_arrives_intact(
    sandbox: LocalSandbox, model: ScriptedModel, opencode_installed: Path, prompt: str
) -> None:
    result, report = await run_direct(
        OpenCodeHarness(), sandbox, model, opencode_installed, prompt, [{"type": "text", "text": "done"}]
    )
    assert result.exit_code == 0, result.stderr_tail
    requests = model.requests("direct")
    assert [r.aux for r in requests] == [False]  # --title: no title request took a step
    assert user_texts(requests[0].body) == [prompt]
    assert report.messages[0].role == "user" and report.messages[0].text.startswith(prompt[:1000])
    assert report.final_text == "done"


async def test_config_is_private_and_holds_no_token(
    sandbox: LocalSandbox, model: ScriptedModel, opencode_installed: Path
) -> None:
    result, report = await run_direct(
        OpenCodeHarness(), sandbox, model, opencode_installed, "hi", [{"type": "text", "text": "done"}]
    )
    assert result.exit_code == 0 and report.claimed_failure is None
    config = Path(sandbox.home) / ".config" / "opencode" / "opencode.json"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert "sk-session-token" not in config.read_text()
    assert json.loads(config.read_text())["autoupdate"] is False
    [request] = model.requests("direct")
    assert request.body["model"] == MODEL
    # The merged transcript is one self-contained SQLite file, kept as evidence.
    assert report.native_transcript_path and report.native_transcript_path.endswith(".db")
    assert (await sandbox.read_file(report.native_transcript_path, 16)).startswith(b"SQLite format 3")
