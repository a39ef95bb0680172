"""The `command` harness: any shell command as the agent, e.g. your own agent script, or `true` as a
null harness for measuring the executor itself.

The command runs in the workspace with the model endpoint in OPENAI_BASE_URL / OPENAI_API_KEY (the
gateway's session prefix and token) and the prompt in ROLLOUT_PROMPT. Its last stdout line is its final
answer; a non-zero exit is a crash. There is no event stream, so no tool calls or usage are reported.
"""

from __future__ import annotations

from pathlib import Path

from harnesses.base import HarnessApi, HarnessReport, Launch, LaunchContext, Message
from sandboxes.base import ExecResult, Sandbox

DEFAULT_COMMAND = "echo done"


class CommandHarness:
    name = "command"
    tested_version = "1"
    api: HarnessApi | None = None  # the command is the user's: it may call either API, or none

    def __init__(self, version: str | None = None, command: str | None = None) -> None:
        self.version = version or self.tested_version
        self.command = command or DEFAULT_COMMAND

    def ensure_installed(self, cache_root: Path) -> Path:
        return cache_root  # nothing to install: the command is the sandbox's own

    async def prepare(self, sandbox: Sandbox, ctx: LaunchContext) -> Launch:
        env = {
            "OPENAI_BASE_URL": ctx.base_url,
            "OPENAI_API_KEY": ctx.api_key,
            "ROLLOUT_PROMPT": ctx.prompt,
            "ROLLOUT_MODEL": ctx.model,
        }
        return Launch(argv=["sh", "-c", self.command], env=env)

    async def parse(self, sandbox: Sandbox, result: ExecResult) -> HarnessReport:
        lines = [line for line in result.stdout_tail.splitlines() if line.strip()]
        final = lines[-1].strip() if lines else None
        messages = [Message(role="assistant", text=final)] if final else []
        return HarnessReport(
            messages=messages, final_text=final, evidence_gaps=["transcript_unavailable", "usage_unavailable"]
        )
