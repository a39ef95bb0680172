"""A scripted, OpenAI-compatible model server that stands in for a real LLM endpoint.

Each session (keyed by the `x-rollout-session` header or a `/s/<key>/v1` URL prefix) plays its own list of
steps: text answers, tool calls matched to whatever shell or write tool the client offers, HTTP errors, a
stream cut mid-way (reset, or ended cleanly without its terminal event), an error inside a 200 answer, a
hang (before the answer or in its middle), a stream of keep-alive comments only, or a 2xx that is no
answer (an HTML page, JSON for a stream, an empty body). It
speaks Chat Completions (OpenCode, Pi, Hermes) and the Responses API (Codex) closely enough for those real
clients to run against it. An outage window (``outage``) answers every request with one error for a
while, whatever the scripts say, then lets them play on.

The steps and their parse sit in ``steps``; what a step answers, fitted to the client's tools, in
``replies``; the two dialects in ``chat`` and ``responses`` (with ``tokens`` for stream pieces, token ids
and logprobs); OpenAI-shaped errors in ``errors``; the answers that go wrong on purpose in ``faults``; the
server (``ScriptedModel``, ``serve``) in ``server``. Imports run that way round: ``server`` imports the
rest, ``steps`` nothing of theirs.
"""

from harnesses.testing.scripted_model.replies import AUX_TEXT
from harnesses.testing.scripted_model.server import (
    MAX_WAITS,
    SESSION_HEADER,
    OutageReport,
    RequestLog,
    ScriptedModel,
    serve,
)
from harnesses.testing.scripted_model.steps import (
    BadAnswerStep,
    DropStep,
    ErrorStep,
    HangStep,
    KeepaliveStep,
    ShellStep,
    Step,
    StreamErrorStep,
    TextStep,
    ToolStep,
    WaitStep,
    WriteStep,
    parse_steps,
)

__all__ = [
    "AUX_TEXT",
    "MAX_WAITS",
    "SESSION_HEADER",
    "BadAnswerStep",
    "DropStep",
    "ErrorStep",
    "HangStep",
    "KeepaliveStep",
    "OutageReport",
    "RequestLog",
    "ScriptedModel",
    "ShellStep",
    "Step",
    "StreamErrorStep",
    "TextStep",
    "ToolStep",
    "WaitStep",
    "WriteStep",
    "parse_steps",
    "serve",
]
