"""Where a model call goes and what it says when it gets there: the run's, never the sandbox's.

``Upstream`` is the endpoint a request goes to (URL and key) and the run's pins for it: the model name,
the output-token cap and the parameters the run sets. ``Relay.upstream_for`` is the one place that picks
it for a session, so more endpoints (replicas, policy versions) hook in there.

``pin`` turns the body a harness sent into the body that goes upstream: the run's model name in place of
whatever was named (rewritten, not refused: a harness's title or summary call to a "small" model is
answered by the run's model), only the parameters of an allow-list, the output tokens capped, ``n`` and
any tier, routing, storage or hosted-tool option dropped, then the run's own parameters over all. A body
that needs no change goes upstream byte for byte.

``probe_body`` is the smallest real request on either API: the preflight sends it before a run, and the
gateway sends it to tell an error of the run's (model, key, URL) from one the sandbox's request caused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from harnesses.gateway.capture import add_token_params
from harnesses.gateway.limits import CHAT_PATH, RESPONSES_PATH, GatewayConfig

Api = Literal["responses", "chat"]
API_PATHS: dict[Api, str] = {"responses": RESPONSES_PATH, "chat": CHAT_PATH}

# Named among a request's pinned fields when its body was sent upstream as the gateway read it, not as
# the sandbox wrote it (see _parse).
AMBIGUOUS_BODY = "(ambiguous body)"

# What a harness may set on a model call. Everything else (n, service_tier, user, metadata, logit_bias,
# previous_response_id, background, web_search_options, a server's own extras such as top_k or
# chat_template_kwargs, ...) is dropped unless the run sets it in model.parameters.
CHAT_FIELDS = frozenset(
    {
        "messages",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "temperature",
        "top_p",
        "stop",
        "response_format",
        "seed",
        "reasoning_effort",
        "frequency_penalty",
        "presence_penalty",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "max_completion_tokens",
        "store",
        "prompt_cache_key",
    }
)
RESPONSES_FIELDS = frozenset(
    {
        "input",
        "instructions",
        "stream",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "temperature",
        "top_p",
        "reasoning",
        "text",
        "include",
        "max_output_tokens",
        "store",
        "prompt_cache_key",
        "truncation",
        "top_logprobs",
    }
)
_OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# Tools the harness runs itself; a hosted one (web search, file search, code interpreter, MCP) would have
# the provider reach out on the sandbox's behalf.
_TOOL_TYPES = frozenset({"function", "custom", "local_shell"})
_INCLUDES = frozenset({"reasoning.encrypted_content", "message.output_text.logprobs"})
MAX_NOTED_FIELDS = 20  # names of changed fields a request notes (a hostile body may carry thousands)


@dataclass(frozen=True)
class Upstream:
    """One endpoint and the run's pins for it. ``model`` None: the name is passed as sent (tests that
    drive the gateway alone); every other pin holds."""

    base_url: str
    api_key: str | None
    model: str | None = None
    max_output_tokens: int | None = None  # None: the gateway's own max_output_tokens
    parameters: dict[str, Any] = field(default_factory=dict)  # the run's, over the harness's

    def url(self, rest: str, query: str) -> str:
        return f"{self.base_url.rstrip('/')}/{rest}" + (f"?{query}" if query else "")


@dataclass(frozen=True)
class Pinned:
    """The body that goes upstream, or why none does (``refused``: a body that is no JSON object)."""

    body: bytes
    stream: bool = False  # the harness asked for an event stream
    changed: tuple[str, ...] = ()  # the fields rewritten, capped or dropped
    capture_tokens: bool = False  # token ids and logprobs were asked for
    refused: str | None = None


def pin(body: bytes, path: str, upstream: Upstream, config: GatewayConfig) -> Pinned:
    """The pinned body for a model call to ``path`` (CPU work: run it off the event loop when large)."""
    data, ambiguous = _parse(body)
    if not isinstance(data, dict):
        return Pinned(b"", refused="the request body is not a JSON object")
    # A body that another parser may read otherwise than ours goes upstream as we read it: with a key
    # twice, the first "model" could be the one an endpoint takes while we checked the last.
    changed: list[str] = [AMBIGUOUS_BODY] if ambiguous else []
    allowed = CHAT_FIELDS if path == CHAT_PATH else RESPONSES_FIELDS
    dropped = [name for name in data if name not in allowed and name != "model"]
    for name in dropped:
        del data[name]
    if upstream.model is not None and data.get("model") != upstream.model:
        data["model"] = upstream.model
        changed.append("model")
    cap = upstream.max_output_tokens or config.max_output_tokens
    for name in _OUTPUT_FIELDS:
        value = data.get(name)
        if name in data and not (isinstance(value, int) and not isinstance(value, bool) and 0 < value <= cap):
            data[name] = cap
            changed.append(name)
    if upstream.max_output_tokens is not None and not any(n in data for n in _OUTPUT_FIELDS):
        # The run's cap holds even for a harness that asks for none (Codex); max_completion_tokens is the
        # name every current Chat server takes (the newest models refuse max_tokens).
        data["max_output_tokens" if path == RESPONSES_PATH else "max_completion_tokens"] = cap
        changed.append("max_output_tokens" if path == RESPONSES_PATH else "max_completion_tokens")
    _pin_options(data, changed)
    for name, value in upstream.parameters.items():
        if data.get(name) != value:
            data[name] = value
            changed.append(name)
    changed += dropped  # after the pins, so a body full of junk names cannot hide them from the record
    stream = data.get("stream") is True
    capture = config.capture_tokens
    if capture:
        add_token_params(data, path, config.top_logprobs)
    if not changed and not capture:
        return Pinned(body, stream=stream)
    out = _dump(data)
    noted = tuple(name[:40] for name in changed[:MAX_NOTED_FIELDS])
    return Pinned(out, stream=stream, changed=noted, capture_tokens=capture)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("a key named twice")
    return obj


_STRICT = json.JSONDecoder(object_pairs_hook=_unique_keys)


def _parse(body: bytes) -> tuple[Any, bool]:
    """The body's JSON value, and whether it is ambiguous: not UTF-8, or an object in it names a key
    twice (which of the two a parser keeps is its own choice; ours keeps the last)."""
    try:
        return _STRICT.decode(body.decode("utf-8")), False
    except RecursionError:  # nested past the parser's depth: no request a harness sends
        return None, False
    except ValueError:  # a key twice, not UTF-8 (a BOM, another encoding), or no JSON at all
        pass
    try:
        return json.loads(body), True
    except (ValueError, RecursionError):
        return None, False


def _dump(data: dict[str, Any]) -> bytes:
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate, which the body wrote escaped: escaped again
        return json.dumps(data, separators=(",", ":")).encode()


def _pin_options(data: dict[str, Any], changed: list[str]) -> None:
    """The options a harness may name only in their harmless forms."""
    if "stream" in data and not isinstance(data["stream"], bool):
        # The gateway reads anything but true as no stream; an endpoint's lax parser reads "true" or 1 as
        # one, and the stream the gateway never asked for would be judged an upstream failure, never graded.
        data["stream"] = False
        changed.append("stream")
    if "store" in data and data["store"] is not False:
        data["store"] = False  # a hosted endpoint keeps nothing another request could name
        changed.append("store")
    options = data.get("stream_options")
    plain = isinstance(options, dict) and set(options) <= {"include_usage"}
    if "stream_options" in data and not (plain and isinstance(options.get("include_usage", False), bool)):
        usage = options.get("include_usage") if isinstance(options, dict) else None
        data["stream_options"] = {"include_usage": usage is True}
        changed.append("stream_options")
    tools = data.get("tools")
    if isinstance(tools, list):
        kept = [t for t in tools if isinstance(t, dict) and t.get("type") in _TOOL_TYPES]
        if len(kept) != len(tools):
            data["tools"] = kept
            changed.append("tools")
    include = data.get("include")
    if "include" in data:
        kept_includes = [i for i in include if i in _INCLUDES] if isinstance(include, list) else []
        if kept_includes != include:
            data["include"] = kept_includes
            changed.append("include")


# -- the smallest real request, shared with the preflight ----------------------------------------------------

PROBE_PROMPT = "Reply with the single word OK."
# 16 is the Responses API's smallest max_output_tokens; a reasoning model that spends them all still
# answers 200 (incomplete), which is all a probe needs.
PROBE_MAX_TOKENS = 16
# Chat's output-token field: max_tokens is what every server took for years; the newest reasoning models
# refuse it and want max_completion_tokens, which older servers may not know. Tried in this order.
CHAT_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


def probe_body(api: Api, model: str, token_field: str = "max_tokens") -> dict[str, Any]:
    if api == "responses":
        return {
            "model": model,
            "input": PROBE_PROMPT,
            "max_output_tokens": PROBE_MAX_TOKENS,
            "stream": False,
            "store": False,  # a hosted endpoint keeps nothing of the check
        }
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROBE_PROMPT}],
        token_field: PROBE_MAX_TOKENS,
        "stream": False,
    }


def refuses_token_field(status: int, body: bytes | str, token_field: str) -> bool:
    """A 400 that names the output-token field the probe used: try the other one (max_tokens is
    "unsupported" on the newest models; an old server may not know max_completion_tokens)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return status in (400, 422) and token_field in text[:20_000]
