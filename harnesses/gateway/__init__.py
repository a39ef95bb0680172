"""The model gateway: the one door between a sandboxed harness and the real model endpoint.

One aiohttp server per worker; one unguessable URL prefix per session (``/s/<token>/v1/...``), so every
request is attributed to its rollout and a sandbox never sees the real API key. The gateway retries
429 / 5xx / 408 / transport failures upstream with the same body bytes while no byte of the answer has
reached the harness, records every upstream attempt as the session's authoritative evidence, and once it
gives up on a session answers every further request with the one neutral 400 that stops all four harnesses
after a single request (``CLOSED_BODY``), so their own retry loops cannot multiply the load.

Every upstream attempt is bounded in time: its first content within ``first_byte_timeout_s`` of sending,
then no gap between contents longer than ``chunk_timeout_s`` (SSE comments and keep-alives are no
content); a stall is a ``model_timeout``, retried like a transport failure while nothing reached the
harness. An error the endpoint reports inside a 200 answer is that attempt's failure; a 2xx that is not
what was asked (a page, JSON for a stream) is retried like a 5xx; a stream that ends without its terminal
event is a cut. Only model calls and model listings reach the endpoint; any other path is answered here.
Per session it keeps the time spent waiting on the model and, at close, whether a request had stalled (a
deadline falling then is the model's fault, not the agent's).

The gateway is the policy's boundary too: what goes upstream is the run's (its model name, parameters from
an allow-list capped by its config, only the gateway's headers: ``upstream``), each session's requests are
bounded (count, rate, concurrency, body size, kept bytes) and so is the worker's memory for bodies in
flight; an error that only one session's request draws is that session's, and only the run's own probe
failing the same way makes it the run's (``probe``).

Everything runs on the worker's event loop: call ``open_session`` / ``close_session`` from that loop.

The modules, each importing only those listed before it (no loop):
- ``limits``: the configurable bounds (``GatewayConfig``) and the fixed ones, the routes and headers that
  pass, the answers the gateway gives itself;
- ``capture``: what is read from the passing bytes: kept bodies (gzip), content as opposed to keep-alives,
  usage, terminal events and in-answer errors, token ids and logprobs;
- ``upstream``: ``Upstream`` (the endpoint and the run's pins) and ``pin``, the body that goes upstream;
  the probe body shared with the preflight;
- ``session``: ``AttemptRecord`` and ``GatewaySession``, whose state changes only through its methods
  (the per-session budget and bounds, overflows, close, model-wait accounting, the owner's end);
- ``attempt``: one harness request and each upstream attempt at it, up to its record;
- ``probe``: ``RunProbe``, whose fault a 401/403/402/404 is;
- ``relay``: the endpoint's side: the upstream request, the retry loop, the judgement and relay of an
  answer, listings; ``Relay.upstream_for`` is where a session's endpoint is chosen;
- ``server``: ``Gateway``: listening, sessions, routing, the worker's bound on bodies in flight.
"""

from typing import TYPE_CHECKING, Any

from harnesses.gateway.limits import (
    CLOSED_BODY,
    NO_LISTING_BODY,
    NOT_SERVED_BODY,
    SESSION_HEADER,
    GatewayConfig,
)
from harnesses.gateway.session import AttemptRecord, GatewaySession

if TYPE_CHECKING:
    from harnesses.gateway.server import Gateway


def __getattr__(name: str) -> Any:
    # The server (and aiohttp, ~0.2 s of CPU to import) only where a gateway runs: a driver reading a
    # config needs GatewayConfig alone.
    if name == "Gateway":
        from harnesses.gateway.server import Gateway

        return Gateway
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CLOSED_BODY",
    "NOT_SERVED_BODY",
    "NO_LISTING_BODY",
    "SESSION_HEADER",
    "AttemptRecord",
    "Gateway",
    "GatewayConfig",
    "GatewaySession",
]
