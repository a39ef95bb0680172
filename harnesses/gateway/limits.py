"""Every bound the gateway keeps, the paths it lets through and the answers it gives itself.

The configurable bounds (``GatewayConfig``) and the fixed ones, the allow-list of routes and headers, and
the neutral bodies that stop a harness. Every other module of the package reads them, so they sit below
everything and import nothing of the package: that is what keeps the package free of import loops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from aiohttp import web


class GatewayConfig(BaseModel):
    """The gateway's bounds. Attempt budgets count upstream attempts, the first one included."""

    model_config = ConfigDict(extra="forbid")

    max_attempts_per_request: int = Field(default=4, ge=1, le=100)
    # Failed upstream attempts (429 / 5xx / 408 / transport, stream cuts included) over the whole session.
    # Successful calls do not count: a long agent session makes hundreds of them.
    max_attempts_per_session: int = Field(default=24, ge=1)
    # Counted from a request's first failure: no retry starts past it.
    retry_deadline_s: float = Field(default=120.0, ge=0)
    backoff_base_s: float = Field(default=0.5, ge=0)  # exponential, full jitter, Retry-After as a floor
    backoff_cap_s: float = Field(default=8.0, ge=0)
    max_retry_after_s: float = Field(default=60.0, ge=0)  # a longer hint ends the retries of that request
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # A stalled attempt is a model_timeout, retried like a transport failure while nothing reached the
    # harness. From sending an attempt to its first body byte (the wait for the headers included):
    first_byte_timeout_s: float = Field(default=120.0, gt=0)
    chunk_timeout_s: float = Field(default=60.0, gt=0)  # the longest gap between body bytes after that
    # How long a harness may stop reading before its answer is cut. Also the socket-level backstop behind
    # the two stall bounds (aiohttp's sock_read), never shorter than either of them.
    read_timeout_s: float = Field(default=300.0, gt=0)
    max_context_overflows: int = Field(default=3, ge=0)  # per session; OpenCode can loop on them forever
    keep_bodies: bool = True  # request and response bodies into the evidence dir, gzip
    max_body_bytes: int = Field(default=32 * 2**20, ge=0)  # per kept body; the record says when it was cut
    # Ask the endpoint (vLLM's OpenAI-compatible server) for token ids and logprobs and record them per
    # model call, so a trainer needs no retokenization. Off, requests go upstream byte for byte.
    capture_tokens: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # None: not asked for
    # -- what one session (one sandbox, written by the policy) may ask of the gateway ------------------------
    # Model calls forwarded upstream over the whole session; past it the session is closed as
    # agent_request_limit (a long agent session makes a few hundred).
    max_requests_per_session: int = Field(default=2_000, ge=1)
    # Requests (model calls and listings) sent in any 60 s window; one past it waits at the gateway for its
    # turn (no failure, no upstream load): an agent looping on the model is slowed, a harness never notices.
    # Listings past max_requests_per_session get the neutral no-listing answer.
    max_requests_per_minute: int = Field(default=120, ge=1)
    # A session's requests at the gateway at once (harnesses make one, a title or summary call beside it);
    # one more is answered with a neutral 400 at once and counted.
    max_concurrent_requests: int = Field(default=8, ge=1)
    # One request body; a larger one is never read whole: the session is closed as agent_request_limit.
    max_request_bytes: int = Field(default=32 * 2**20, ge=1024, le=256 * 2**20)
    # Compressed bodies kept in the session's evidence dir; past it bodies are no longer kept and the row
    # says so (evidence gap model_bodies_not_kept). The attempt records themselves are always kept.
    max_kept_bytes_per_session: int = Field(default=256 * 2**20, ge=0)
    # Request bodies the whole worker holds in memory at once (read, rewritten, retried); a request that
    # finds no room waits up to first_byte_timeout_s for it, then is that session's provider_unavailable.
    max_inflight_body_bytes: int = Field(default=512 * 2**20, ge=1024)
    # The output-token ceiling of a model call when the run's model.max_output_tokens sets none: a larger
    # max_tokens / max_completion_tokens / max_output_tokens is lowered to it.
    max_output_tokens: int = Field(default=32_768, ge=1)


MAX_REQUEST_BYTES = 256 * 2**20  # the most max_request_bytes may be; aiohttp's own cap sits above it
MAX_HELD_BYTES = 64 * 2**20  # a non-streamed answer is relayed whole up to this, streamed on past it
MAX_ERROR_BODY_BYTES = 2**20  # an error answer is read (and relayed) up to this; real ones are tiny
MAX_LISTING_BYTES = 16 * 2**20  # a model listing; OpenRouter's is a few MiB
MAX_SNIFF_LINE_BYTES = 4 * 2**20  # an SSE line longer than this is not parsed for usage
# With capture_tokens the final Responses event repeats the prompt's ids and text: past 4 MiB in a long run.
MAX_CAPTURE_LINE_BYTES = 48 * 2**20
MAX_MESSAGE_CHARS = 2_000
MAX_CAPTURED_TOKENS = 1_000_000  # per list per model call; past it the record says tokens_truncated
MAX_TOKEN_ID = 2**31 - 1  # the row stores int32; an id past it is not a real vocabulary's
MAX_CONNECTIONS = 512
KEEPALIVE_S = 30.0

# The two model-call APIs; their requests ask for token ids when capture_tokens is on.
CHAT_PATH, RESPONSES_PATH = "/chat/completions", "/responses"
MODEL_CALLS = frozenset({CHAT_PATH[1:], RESPONSES_PATH[1:]})  # POST, the path after /v1/


def route(method: str, rest: str) -> str | None:
    """What a request under /v1/ is: a model call, a model listing (GET models, GET models/<id>), or
    neither (None: answered here, never forwarded)."""
    if method == "POST" and rest in MODEL_CALLS:
        return "call"
    if method == "GET" and (rest == "models" or (rest.startswith("models/") and len(rest) > len("models/"))):
        return "listing"
    return None


SESSION_HEADER = "x-rollout-session"  # the scripted model keys its scripts on it; a real endpoint ignores it

# Of the endpoint's answer headers, these are the connection's, not the answer's. None of the harness's
# request headers go upstream: the relay sends its own (relay._upstream_headers).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
NOT_RELAYED = HOP_BY_HOP | {"content-length"}

# The only answer that ends all four harnesses' loops after one request, as measured on each. They match on
# the whole body, so it must stay free of status digits (429, 500, 503, ...) and of words like retry,
# rate, timeout, connection, overloaded or context; and at least 30 characters long for Hermes.
CLOSED_BODY = (
    b'{"error":{"message":"gateway: session closed by gateway policy; no further model calls allowed",'
    b'"type":"invalid_request_error","code":"gateway_session_closed"}}'
)
# Any path but a model call or a model listing: answered here, never forwarded with the real key (files,
# fine-tuning, batches, LoRA load/unload live there). As neutral as CLOSED_BODY, for the same reasons.
NOT_SERVED_BODY = (
    b'{"error":{"message":"gateway: this path is not served; only model calls and model listings pass",'
    b'"type":"invalid_request_error","code":"gateway_path_not_served"}}'
)
# A model listing the endpoint did not give (no answer, a stall, a 5xx): the harness's lookup goes on
# without it, and a 5xx's words must not reach a harness that matches on them.
NO_LISTING_BODY = (
    b'{"error":{"message":"gateway: the endpoint gave no usable model listing for this lookup",'
    b'"type":"invalid_request_error","code":"gateway_listing_missing"}}'
)


# A model call whose body is no JSON object: never sent upstream. As neutral as CLOSED_BODY.
REFUSED_BODY = (
    b'{"error":{"message":"gateway: the request body is not a JSON object; it was not sent on",'
    b'"type":"invalid_request_error","code":"gateway_body_refused"}}'
)


# A request from a process of the sandbox other than the harness's (sandboxes/netns.py): the agent's own
# code, which has no model calls of its own to make. Never sent upstream, so no failure it could draw there
# is the session's.
NOT_THE_HARNESS_BODY = (
    b'{"error":{"message":"gateway: model calls are the harness\'s; this one came from another process '
    b'of the sandbox and was not sent on","type":"invalid_request_error","code":"gateway_not_the_harness"}}'
)


def not_the_harness() -> web.Response:
    return _answer(403, NOT_THE_HARNESS_BODY)


def refused_body() -> web.Response:
    return _answer(400, REFUSED_BODY)


def closed() -> web.Response:
    return _answer(400, CLOSED_BODY)


def not_served() -> web.Response:
    return _answer(404, NOT_SERVED_BODY)


def no_listing() -> web.Response:
    return _answer(404, NO_LISTING_BODY)


def _answer(status: int, body: bytes) -> web.Response:
    from aiohttp import web  # imported by the server that calls this; not by a config that is only read

    return web.Response(status=status, body=body, content_type="application/json")
