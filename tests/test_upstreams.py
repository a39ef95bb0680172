"""harnesses/gateway/upstreams.py: policy versions and replicas, alone and through a real gateway (real
HTTP upstreams, the harness side played by an HTTP client)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from harnesses.gateway import Gateway, GatewayConfig
from harnesses.gateway.upstreams import Upstreams
from policy import FailureKind
from tests.test_gateway import FAST, ask, upstream_server

ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


def recorder(name: str, seen: list[tuple[str, dict[str, str]]], status: int = 200) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append((name, dict(request.headers)))
        if status != 200:
            return web.json_response({"error": {"message": "down"}}, status=status)
        return web.json_response(ANSWER)

    return handle


def test_versions_in_place_and_moved_to_new_servers():
    up = Upstreams(["http://a/v1"], "m", version=1)
    first = up.pin()
    assert (first.version, first.replica, first.model, up.answering(first)) == (1, "http://a/v1", "m", 1)
    up.announce(2)  # new weights on the same servers: a running session's calls are answered by 2
    assert up.answering(first) == 2
    up.announce(3, ["http://b/v1", "http://c/v1"], "m3")  # new servers: the old session stays, on 2
    assert up.answering(first) == 2 and first.replica == "http://a/v1"
    later = up.pin()
    assert (later.version, later.model, up.answering(later)) == (3, "m3", 3)
    assert later.replica in ("http://b/v1", "http://c/v1")
    assert up.pin(1).replica == "http://a/v1" and up.pin(2).model == "m"  # a session sent under 2
    assert up.announce(2) is False and up.current == 3  # an older announcement changes nothing


async def test_sessions_spread_stay_on_their_replica_and_name_themselves(harness, tmp_path):
    seen: list[tuple[str, dict[str, str]]] = []
    async with upstream_server(recorder("a", seen)) as a, upstream_server(recorder("b", seen)) as b:
        up = Upstreams([a, b], "m", affinity_header="x-session-affinity")
        gateway = Gateway(up, None, GatewayConfig(**FAST))
        await gateway.start()
        try:
            sessions = [gateway.open_session(f"s{i}", tmp_path / f"s{i}") for i in range(4)]
            for _ in range(3):
                for session in sessions:
                    assert (await ask(harness, session)).status_code == 200
        finally:
            await gateway.stop()
    by_session: dict[str, set[str]] = {}
    for name, headers in seen:
        by_session.setdefault(headers["x-session-affinity"], set()).add(name)
    assert by_session == {"s0": {"a"}, "s1": {"b"}, "s2": {"a"}, "s3": {"b"}}
    for session in sessions:
        replicas = {r.replica for r in session.attempts}
        assert len(session.attempts) == 3 and replicas == {a if session.session_id in ("s0", "s2") else b}


async def test_a_failing_replica_is_taken_out_and_comes_back(harness, tmp_path, monkeypatch):
    seen: list[tuple[str, dict[str, str]]] = []
    down, up_ = recorder("down", seen, status=503), recorder("up", seen)
    async with upstream_server(down) as bad, upstream_server(up_) as good:
        up = Upstreams([bad, good], "m", version=7, failures_to_eject=2, cooldown_s=600)
        gateway = Gateway(up, None, GatewayConfig(**{**FAST, "max_attempts_per_request": 4}))
        await gateway.start()
        try:
            session = gateway.open_session("s0", tmp_path / "s0")
            assert session.route is not None and session.route.replica == bad  # both empty: the first
            assert (await ask(harness, session)).status_code == 200
            later = gateway.open_session("s1", tmp_path / "s1")
        finally:
            await gateway.stop()
    records = [(r.replica, r.status, r.kind, r.policy_version) for r in session.attempts]
    assert records == [
        (bad, 503, FailureKind.PROVIDER_UNAVAILABLE, 7),
        (bad, 503, FailureKind.PROVIDER_UNAVAILABLE, 7),
        (good, 200, FailureKind.NONE, 7),
    ]
    assert later.route is not None and later.route.replica == good  # out of service: not chosen
    assert up.in_service() == [good]
    import harnesses.gateway.upstreams as module

    now = module.time.monotonic()
    monkeypatch.setattr(module.time, "monotonic", lambda: now + 601)  # past the cooldown
    assert up.in_service() == [bad, good]
    assert [n for n, _ in seen] == ["down", "down", "up"]
