"""The endpoints behind the gateway: the policy versions a trainer announces, and the replicas of each.

A version names an endpoint: one or several base URLs (replicas of one model server) and a model name. A
session is pinned when it opens, to the endpoint of the version it started under and to one replica of it
(the one in service with the fewest sessions now, then the fewest so far), so that its requests reach one
server's prefix cache; with ``affinity_header`` set, each of its requests also names the session in that
header, for a router in front of the replicas. A version announced with the same endpoint as an earlier
one is a weight update in place: a call made after it is answered by the new version, and that is the
version its record names.

A replica whose attempts fail ``failures_to_eject`` times in a row (no answer, a 5xx, a stall) is taken
out of service for ``cooldown_s``: a session pinned to it moves to another replica of its endpoint at its
next attempt, new sessions are not pinned to it, and after the cooldown it is tried again (one more
failure takes it out again). With every replica out, the least recently failed one is used: an outage
of all of them is the retry loop's to report, not this module's.

Runs on the gateway's event loop: no locks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MAX_VERSIONS_KEPT = 4096  # announcements remembered; a session pinned to an older one uses the oldest kept


@dataclass(frozen=True)
class Endpoint:
    base_urls: tuple[str, ...]
    model: str | None  # None: the request's own model name goes upstream


@dataclass(eq=False)
class Route:
    """One session's pin: the version it started under, its endpoint, and the replica it uses now."""

    version: int | None
    endpoint: Endpoint
    replica: str

    @property
    def model(self) -> str | None:
        return self.endpoint.model


@dataclass
class _Replica:
    sessions: int = 0
    pinned: int = 0  # sessions ever pinned to it: among replicas as busy, the least used is chosen
    failures: int = 0  # in a row
    out_until: float = 0.0  # monotonic; in service from then on
    last_failure: float = field(default=-float("inf"))


class Upstreams:
    def __init__(
        self,
        base_urls: str | list[str] | tuple[str, ...],
        model: str | None = None,
        *,
        version: int | None = None,
        affinity_header: str | None = None,
        failures_to_eject: int = 3,
        cooldown_s: float = 30.0,
    ) -> None:
        self.affinity_header = affinity_header
        self.failures_to_eject = failures_to_eject
        self.cooldown_s = cooldown_s
        self._versions: dict[int | None, Endpoint] = {}
        self._latest_for: dict[Endpoint, int | None] = {}  # the newest version announced per endpoint
        self._replicas: dict[str, _Replica] = {}
        self.current: int | None = None
        self.announce(version, base_urls, model)

    # -- versions -----------------------------------------------------------------------------------------

    def announce(
        self,
        version: int | None,
        base_urls: str | list[str] | tuple[str, ...] | None = None,
        model: str | None = None,
    ) -> bool:
        """Version ``version`` is served at ``base_urls`` as ``model`` (each, when None, as the current
        version is). Idempotent. A version older than the current one is remembered for the sessions
        that start under it, and changes nothing else (False)."""
        before = self._versions.get(self.current)
        urls = _urls(base_urls) if base_urls else (before.base_urls if before else ())
        if not urls:
            raise ValueError("an upstream needs at least one base URL")
        endpoint = Endpoint(urls, model if model is not None else (before.model if before else None))
        for url in urls:
            self._replicas.setdefault(url, _Replica())
        newer = not self._versions or (
            version is not None and (self.current is None or version > self.current)
        )
        self._versions.setdefault(version, endpoint)
        if newer:
            self._versions[version] = endpoint
            self._latest_for[endpoint] = version
            self.current = version
        while len(self._versions) > MAX_VERSIONS_KEPT:
            del self._versions[next(iter(self._versions))]
        return newer

    def answering(self, route: Route) -> int | None:
        """The version that answers a call of ``route`` now: the newest announced at its endpoint."""
        return self._latest_for.get(route.endpoint, route.version)

    # -- sessions -----------------------------------------------------------------------------------------

    def pin(self, version: int | None = None) -> Route:
        """A route for a session starting under ``version`` (the current one when None); a version not
        known here goes to the current version's endpoint."""
        version = self.current if version is None else version
        endpoint = self._versions.get(version) or self._versions[self.current]
        route = Route(version, endpoint, self._choose(endpoint))
        self._take(route.replica)
        return route

    def unpin(self, route: Route) -> None:
        replica = self._replicas.get(route.replica)
        if replica is not None and replica.sessions > 0:
            replica.sessions -= 1

    def replica_for(self, route: Route) -> str:
        """The replica ``route``'s next attempt goes to: its own while in service, else another."""
        if self._in_service(route.replica, time.monotonic()):
            return route.replica
        moved = self._choose(route.endpoint)
        if moved != route.replica:
            self.unpin(route)
            self._take(moved)
            route.replica = moved
        return moved

    def base_url(self) -> str:
        """A replica of the current version, for a request of no session's route."""
        return self._choose(self._versions[self.current])

    def headers(self, session_id: str) -> list[tuple[str, str]]:
        return [(self.affinity_header, session_id)] if self.affinity_header else []

    # -- replica health -----------------------------------------------------------------------------------

    def failed(self, replica: str) -> None:
        """An attempt at ``replica`` got no usable answer (transport error, 5xx, stall)."""
        state = self._replicas.get(replica)
        if state is None:
            return
        now = time.monotonic()
        state.failures += 1
        state.last_failure = now
        if state.failures >= self.failures_to_eject:
            state.out_until = now + self.cooldown_s

    def succeeded(self, replica: str) -> None:
        state = self._replicas.get(replica)
        if state is not None:
            state.failures = 0
            state.out_until = 0.0

    def in_service(self) -> list[str]:
        now = time.monotonic()
        return [url for url in self._replicas if self._in_service(url, now)]

    def _in_service(self, url: str, now: float) -> bool:
        return self._replicas[url].out_until <= now

    def _choose(self, endpoint: Endpoint) -> str:
        now = time.monotonic()
        serving = [u for u in endpoint.base_urls if self._in_service(u, now)]
        if not serving:
            return min(endpoint.base_urls, key=lambda u: self._replicas[u].last_failure)
        return min(serving, key=lambda u: (self._replicas[u].sessions, self._replicas[u].pinned))

    def _take(self, url: str) -> None:
        self._replicas[url].sessions += 1
        self._replicas[url].pinned += 1


def _urls(base_urls: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    listed = (base_urls,) if isinstance(base_urls, str) else tuple(base_urls)
    return tuple(dict.fromkeys(u.rstrip("/") for u in listed))
