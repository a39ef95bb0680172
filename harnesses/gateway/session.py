"""One rollout's view of the gateway: the record of each upstream attempt and the session's state.

``GatewaySession`` changes only through its own methods: the retry loop spends its budget, the relay
records an overflow or closes it, the server opens and ends its requests, and ``end`` is the owner's close.
What it reads of a request or an attempt in flight is named by two small protocols, so this module imports
nothing of the package but its limits, and the attempt (which holds its session) imports it, not the
other way round.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from harnesses.gateway.limits import GatewayConfig
from harnesses.gateway.upstreams import Route
from policy import FailureKind, bound_text


class AttemptRecord(BaseModel):
    """One upstream attempt, as the endpoint answered it."""

    model_config = ConfigDict(extra="forbid")

    request_index: int  # 0-based, per session, in arrival order
    attempt: int  # 1-based within the request
    method: str
    path: str  # after /v1, e.g. "/responses"
    started_at: float  # epoch seconds
    status: int | None  # None: no HTTP answer at all
    kind: FailureKind  # NONE for a complete 2xx
    error_message: str | None = None
    latency_s: float
    ttfb_s: float | None = None  # to the first content (a data event; keep-alives are not), None if none
    retry_after_s: float | None = None  # the usable Retry-After hint, None when absent or unusable
    streamed: bool = False  # the answer was an event stream
    response_bytes: int = 0
    request_sha256: str
    input_tokens: int | None = None  # None when the answer carried no usage, never 0 for unknown
    output_tokens: int | None = None
    # The API's own word: chat "stop" / "length" / "tool_calls"; Responses "completed" / "failed" or the
    # incomplete reason ("max_output_tokens").
    finish_reason: str | None = None
    request_file: str | None = None  # relative to the session's evidence dir; one file per request
    response_file: str | None = None
    request_truncated: bool = False
    response_truncated: bool = False
    # The harness went away (or stopped reading) before the answer was complete; kind is TRANSPORT_ERROR,
    # and this flag tells that from a failure of the endpoint.
    client_aborted: bool = False
    # With capture_tokens, what the endpoint returned; None when it returned none. The two completion
    # lists are one to one when of equal length (the Responses API gives logprobs for output text only,
    # so a function call's ids come without them).
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    tokens_truncated: bool = False  # a list reached MAX_CAPTURED_TOKENS and was cut there
    # Which policy version and replica answered (upstreams.py); None for a gateway without versions.
    policy_version: int | None = None
    replica: str | None = None


class Outstanding(Protocol):
    """A harness request as the session's time accounting sees it (``attempt.Request``)."""

    @property
    def arrived(self) -> float: ...  # monotonic

    @property
    def last_byte(self) -> float: ...  # monotonic: the arrival, then each upstream body byte


class InFlight(Protocol):
    """An upstream attempt as the session's end sees it (``attempt.Attempt``)."""

    @property
    def req(self) -> Outstanding: ...

    @property
    def answer_delivered(self) -> bool: ...

    def finish(self, kind: FailureKind, message: str | None = None) -> AttemptRecord: ...


OnAttempt = Callable[["GatewaySession", AttemptRecord], None]
MAX_NOTED_NAMES = 50  # distinct field names a session's pinning counts by name


@dataclass(eq=False)
class GatewaySession:
    """One rollout's view of the gateway. ``config`` gives its budgets and stall bounds; ``on_attempt`` is
    called with each record as it is made."""

    session_id: str
    token: str
    base_url: str  # what the harness gets as its base URL, ending in /v1
    evidence_dir: Path
    attempts: list[AttemptRecord] = field(default_factory=list)
    closed_kind: FailureKind | None = None  # why the gateway stopped serving it; None if it never did
    closed_message: str | None = None
    # Set by end(): a request was still outstanding and had gone at least min(first_byte_timeout_s,
    # chunk_timeout_s) without an upstream byte, counted from its arrival and reset by each byte of its
    # answer, not by a retry (classify: a deadline that falls then is model_timeout, not agent_timeout).
    stalled_at_close: bool = False
    # Wall time with at least one of the session's requests (model calls and listings) outstanding at the
    # gateway, from arrival to the end of its answer (retries and backoff included, overlaps counted once),
    # frozen by end() with a request still outstanding then counted up to that moment.
    # model_wait_now() is the live value.
    model_wait_s: float = 0.0
    config: GatewayConfig = field(default_factory=GatewayConfig, kw_only=True, repr=False)
    # The policy version it started under and the replica it uses (upstreams.py); None: the gateway's
    # one upstream.
    route: Route | None = field(default=None, kw_only=True)
    on_attempt: OnAttempt | None = field(default=None, kw_only=True, repr=False)
    # Its harness makes its model calls from one process: a request another process of the sandbox made
    # (sandboxes/netns.py tells them apart) is refused, never forwarded, so no failure it draws upstream
    # is the session's.
    one_client: bool = field(default=False, kw_only=True)
    _requests: int = field(default=0, init=False, repr=False)  # model calls forwarded upstream
    _refused: int = field(default=0, init=False, repr=False)  # answered with CLOSED_BODY, never forwarded
    _probes: int = field(default=0, init=False, repr=False)  # model listings forwarded, not attempts
    _probes_failed: int = field(default=0, init=False, repr=False)
    _pending: set[Outstanding] = field(default_factory=set, init=False, repr=False)  # outstanding requests
    _busy_since: float = field(default=0.0, init=False, repr=False)  # monotonic; valid while _pending
    # The last request to end: how long it had gone without an upstream byte if the harness hung up on it.
    _hung_up_silence: float | None = field(default=None, init=False, repr=False)
    _waited: float = field(default=0.0, init=False, repr=False)  # closed busy spells, summed
    _failures: int = field(default=0, init=False, repr=False)  # against max_attempts_per_session
    _overflows: int = field(default=0, init=False, repr=False)
    _ended: bool = field(default=False, init=False, repr=False)  # end() was called
    # Set by close(): what the session's owner waits on to stop a harness the gateway no longer serves.
    _closed: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    # The session's own bounds (GatewayConfig's max_* per session), each reached one counted for the row.
    _at_gateway: int = field(default=0, init=False, repr=False)  # its requests being served now
    _claimed: int = field(default=0, init=False, repr=False)  # model calls let in, against the count bound
    _over_concurrency: int = field(default=0, init=False, repr=False)
    _starts: deque[float] = field(default_factory=deque, init=False, repr=False)  # model calls, last 60 s
    _rate_waits: int = field(default=0, init=False, repr=False)
    _rate_wait_s: float = field(default=0.0, init=False, repr=False)
    _kept_bytes: int = field(default=0, init=False, repr=False)  # compressed bodies written
    _not_kept: int = field(default=0, init=False, repr=False)  # bodies not kept past the budget
    _pinned: Counter[str] = field(default_factory=Counter, init=False, repr=False)  # fields changed
    _refused_bodies: int = field(default=0, init=False, repr=False)  # not a JSON object: never sent
    _not_the_client: int = field(default=0, init=False, repr=False)  # another process's: never sent
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set, init=False, repr=False)
    _live: set[InFlight] = field(default_factory=set, init=False, repr=False)

    # -- reading ----------------------------------------------------------------------------------------

    def last_failure(self) -> AttemptRecord | None:
        return next((a for a in reversed(self.attempts) if a.kind is not FailureKind.NONE), None)

    def model_wait_now(self) -> float:
        """Seconds spent waiting on the model so far, a request outstanding now included; after end(),
        the frozen ``model_wait_s``."""
        if self._ended:
            return self.model_wait_s
        return self._waited + (time.monotonic() - self._busy_since if self._pending else 0.0)

    def requests_made(self) -> int:
        """Model calls the session made: forwarded, refused after its close, or refused for their body."""
        return self._requests + self._refused + self._refused_bodies + self._over_concurrency

    def outstanding(self) -> int:
        """How many of its requests are at the gateway now (arrived, their answer not yet ended)."""
        return len(self._pending)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self._requests,
            "refused_after_close": self._refused,
            "attempts": len(self.attempts),
            "by_kind": dict(Counter(a.kind.value for a in self.attempts)),
            "client_aborts": sum(a.client_aborted for a in self.attempts),
            "context_overflows": self._overflows,
            "closed_kind": self.closed_kind.value if self.closed_kind else None,
            "probes": self._probes,
            "probes_failed": self._probes_failed,
            "model_wait_s": round(self.model_wait_now(), 3),
            "stalled_at_close": self.stalled_at_close,
            "pinned_fields": dict(self._pinned),
            "refused_bodies": self._refused_bodies,
            "not_the_harness": self._not_the_client,
            "over_concurrency": self._over_concurrency,
            "rate_waits": self._rate_waits,
            "rate_wait_s": round(self._rate_wait_s, 3),
            "kept_bytes": self._kept_bytes,
            "bodies_not_kept": self._not_kept,
        }

    def bounds_reached(self) -> dict[str, Any]:
        """What of the session the gateway changed or held back, for the row's ``error_detail``: the
        fields it pinned and the bounds that slowed or refused a request without ending the session
        (those that end it are the row's failure kind; bodies not kept, its evidence gaps)."""
        reached = {
            "pinned_fields": dict(self._pinned),
            "refused_bodies": self._refused_bodies,
            "not_the_harness": self._not_the_client,
            "over_concurrency": self._over_concurrency,
            "rate_waits": self._rate_waits,
            "rate_wait_s": round(self._rate_wait_s, 3),
        }
        return {name: value for name, value in reached.items() if value}

    def evidence_gaps(self) -> list[str]:
        """What the gateway could not keep of the session, as the row's evidence gap codes."""
        if not self._not_kept:
            return []
        limit = self.config.max_kept_bytes_per_session
        return [f"model_bodies_not_kept: {self._not_kept} bodies past max_kept_bytes_per_session={limit}"]

    # -- requests: counted, and timed while outstanding ---------------------------------------------------

    def next_request_index(self, *, listing: bool) -> int:
        """The index of a model call forwarded upstream; a listing is no model call: -1, no record."""
        if listing:
            return -1
        self._requests += 1
        return self._requests - 1

    # -- the session's own bounds --------------------------------------------------------------------------

    def enter(self) -> bool:
        """A request arrived; False when the session already has ``max_concurrent_requests`` at the
        gateway (it is answered at once and counted). Pair a True with ``leave``."""
        if self._at_gateway >= self.config.max_concurrent_requests:
            self._over_concurrency += 1
            return False
        self._at_gateway += 1
        return True

    def leave(self) -> None:
        self._at_gateway -= 1

    def over_request_count(self) -> bool:
        """The session has made ``max_requests_per_session`` model calls: closed as agent_request_limit.
        Else the call is counted now, before its body is read, so concurrent ones cannot pass the bound."""
        limit = self.config.max_requests_per_session
        if self._claimed < limit:
            self._claimed += 1
            return False
        message = f"the session made {limit} model calls (max_requests_per_session)"
        self.close(FailureKind.AGENT_REQUEST_LIMIT, message)
        return True

    def listings_spent(self) -> bool:
        """The session has had ``max_requests_per_session`` model listings: later ones are answered here."""
        return self._probes >= self.config.max_requests_per_session

    def too_large(self, size: int) -> None:
        """A request body past ``max_request_bytes``: never read whole; the session is closed."""
        limit = self.config.max_request_bytes
        message = f"a request body of {size} bytes passed max_request_bytes={limit}"
        self.close(FailureKind.AGENT_REQUEST_LIMIT, message)

    async def rate_turn(self) -> None:
        """Wait until a request may go upstream within ``max_requests_per_minute`` (at most 60 s)."""
        limit = self.config.max_requests_per_minute
        now = time.monotonic()
        while self._starts and now - self._starts[0] >= 60.0:
            self._starts.popleft()
        # The slot is taken before the wait, so concurrent requests queue behind each other; the times
        # stay in order (each is at least the one before it).
        start = now if len(self._starts) < limit else max(now, self._starts[-limit] + 60.0)
        self._starts.append(start)
        if start > now:
            self._rate_waits += 1
            self._rate_wait_s += start - now
            await asyncio.sleep(start - now)

    def refused_body(self) -> None:
        self._refused_bodies += 1

    def pinned(self, changed: tuple[str, ...]) -> None:
        """Count the fields pinning changed; past MAX_NOTED_NAMES distinct names (a hostile body can carry
        any), the rest under one name."""
        for name in changed:
            known = name in self._pinned or len(self._pinned) < MAX_NOTED_NAMES
            self._pinned[name if known else "(others)"] += 1

    def may_keep(self) -> bool:
        """Bodies may still be kept within ``max_kept_bytes_per_session``."""
        return self._kept_bytes < self.config.max_kept_bytes_per_session

    def kept(self, size: int) -> None:
        self._kept_bytes += size

    def not_kept(self) -> None:
        self._not_kept += 1

    def count_refused(self) -> None:
        """A request answered with CLOSED_BODY because the session was closed, never forwarded."""
        self._refused += 1

    def count_not_the_client(self) -> None:
        """A request from a process of the sandbox other than its harness's, refused (``one_client``)."""
        self._not_the_client += 1

    def count_listing(self) -> None:
        self._probes += 1

    def count_failed_listing(self) -> None:
        self._probes_failed += 1

    @contextlib.contextmanager
    def serving(self, task: asyncio.Task[Any]) -> Iterator[None]:
        """While ``task`` serves one of its requests: end() cancels it."""
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)

    def request_began(self, req: Outstanding) -> None:
        if not self._pending:
            self._busy_since = req.arrived
        self._pending.add(req)

    def request_ended(self, req: Outstanding, *, hung_up: bool = False) -> None:
        if req in self._pending:
            now = time.monotonic()
            self._pending.discard(req)
            if not self._pending:
                self._waited += now - self._busy_since
            # A harness killed at its deadline hangs up first: the request it was waiting on is gone from
            # _pending by the time the session closes, but how long it had waited still tells whose the
            # time was.
            self._hung_up_silence = now - req.last_byte if hung_up else None

    # -- attempts: recorded, and the budgets they spend --------------------------------------------------

    def attempt_started(self, attempt: InFlight) -> None:
        self._live.add(attempt)

    def attempt_finished(self, attempt: InFlight, record: AttemptRecord) -> None:
        """Called once per attempt, with its record."""
        self._live.discard(attempt)
        self.attempts.append(record)
        if self.on_attempt is not None:
            self.on_attempt(self, record)

    def spend(self) -> str | None:
        """Count one failed attempt against the session; say so once the session's budget is spent."""
        self._failures += 1
        if self._failures >= self.config.max_attempts_per_session:
            return f"the session's budget of {self.config.max_attempts_per_session} failed attempts is spent"
        return None

    def spend_after_answer(self, record: AttemptRecord, what: str) -> None:
        """A failure after bytes reached the harness counts against the session; closes it once spent."""
        why = self.spend()
        if why:
            self.close(record.kind, f"{why}; last: {what}: {record.error_message or ''}")

    def overflow(self, record: AttemptRecord) -> bool:
        """Count a context overflow; past the cap the session is closed (True)."""
        self._overflows += 1
        if self._overflows <= self.config.max_context_overflows:
            return False
        message = f"{self._overflows} context overflows in one session; last: {record.error_message or ''}"
        self.close(FailureKind.MODEL_CONTEXT_LIMIT, message)
        return True

    def close(self, kind: FailureKind, message: str) -> None:
        """The gateway stops serving the session: its requests from now on get CLOSED_BODY."""
        if self.closed_kind is None:  # the first cause is the one that explains the row
            self.closed_kind = kind
            self.closed_message = bound_text(message)
            self._closed.set()

    async def wait_closed(self) -> None:
        """Returns once the gateway has closed the session (``close``; not the owner's ``end``)."""
        await self._closed.wait()

    # -- the owner's end ----------------------------------------------------------------------------------

    def end(self, stall_bound_s: float | None = None) -> None:
        """The owner's close (``Gateway.close_session``): cut the in-flight requests, freeze the model wait
        and write ``attempts.jsonl``. Idempotent. ``closed_kind`` is left as it is: the owner closing a
        session is not the endpoint failing. ``stall_bound_s``: a tighter bound than the config's own for
        ``stalled_at_close`` (the owner's share of a short deadline)."""
        if self._ended:
            return
        now = time.monotonic()
        bound = min(
            self.config.first_byte_timeout_s,
            self.config.chunk_timeout_s,
            math.inf if stall_bound_s is None else stall_bound_s,
        )
        stalled = self._stalled(now, bound)
        hung_up_waiting = not self._pending and (self._hung_up_silence or 0.0) >= bound
        self.stalled_at_close = bool(stalled) or hung_up_waiting
        self.model_wait_s = self.model_wait_now()
        self._ended = True
        for attempt in list(self._live):
            if attempt.req in stalled:  # so the record shows what the session's end cut short
                waited = now - attempt.req.last_byte
                message = f"the session was closed while this request had waited {waited:.1f}s for a byte"
                attempt.finish(FailureKind.MODEL_TIMEOUT, message)
            else:
                attempt.finish(FailureKind.CANCELLED, "the session was closed while this attempt ran")
        for task in self._tasks:
            task.cancel()
        lines = "".join(record.model_dump_json() + "\n" for record in self.attempts)
        # The records stay on the session for the row; the file is the copy kept beside the bodies.
        with contextlib.suppress(OSError):
            (self.evidence_dir / "attempts.jsonl").write_text(lines)

    def _stalled(self, now: float, bound: float) -> set[Outstanding]:
        """The outstanding requests that have gone the stall bound without an upstream byte (an answer the
        harness already had in full is not waiting on the model)."""
        answered = {attempt.req for attempt in self._live if attempt.answer_delivered}
        return {r for r in self._pending if r not in answered and now - r.last_byte >= bound}
