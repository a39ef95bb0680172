"""The gateway's CPU per model request of a coding agent's size: chat requests that carry a whole
conversation (``--kb`` each) sent to the scripted model directly and through the gateway (its pinning, the
relay, the kept request and response bodies, the records), alternating round by round in one process;
the difference of the process's CPU between the two sides is the gateway's.

    .venv/bin/python tests/bench/bench_gateway_cpu.py [--requests 40] [--kb 250] [--rounds 6] [--stream]

Prints the median of the rounds' CPU per request for each side and the gateway's share; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harnesses.gateway import Gateway, GatewayConfig
from harnesses.gateway.limits import SESSION_HEADER
from harnesses.testing.scripted_model import ScriptedModel, parse_steps

ANSWER = {"type": "text", "text": "done: the tests pass now, and the change is in src/app.py"}


def conversation(kb: int) -> bytes:
    """A chat request of about ``kb`` KB: source-like turns, as an agent's request re-sends them."""
    source = Path(__file__).read_text() + Path(Gateway.__module__.replace(".", "/") + ".py").read_text()
    messages = [{"role": "system", "content": "You are a coding agent."}]
    while sum(len(m["content"]) for m in messages) < kb * 1024:
        role = "user" if len(messages) % 2 else "assistant"
        start = (len(messages) * 977) % max(1, len(source) - 4000)
        messages.append({"role": role, "content": source[start : start + 4000]})
    return json.dumps({"model": "scripted-model", "messages": messages}).encode()


async def _round(client: httpx.AsyncClient, url: str, headers: dict[str, str], body: bytes, n: int) -> float:
    began = time.process_time()
    for _ in range(n):
        response = await client.post(url, content=body, headers=headers)
        response.raise_for_status()
    return (time.process_time() - began) / n


async def main(requests: int, kb: int, rounds: int, stream: bool) -> None:
    body = json.loads(conversation(kb))
    body["stream"] = stream
    raw = json.dumps(body).encode()
    model = ScriptedModel()
    await model.start()
    gateway = Gateway(model.base_url, None, GatewayConfig())
    await gateway.start()
    direct: list[float] = []
    through: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            async with httpx.AsyncClient(timeout=60) as client:
                for r in range(rounds + 1):  # the first round of each side warms up, and is left out
                    sid = f"direct-{r}"
                    model.set_script(sid, parse_steps([ANSWER] * requests))
                    headers = {"Content-Type": "application/json", SESSION_HEADER: sid}
                    cpu = await _round(client, f"{model.base_url}/chat/completions", headers, raw, requests)
                    if r:
                        direct.append(cpu)
                    sid = f"gateway-{r}"
                    model.set_script(sid, parse_steps([ANSWER] * requests))
                    session = gateway.open_session(sid, Path(scratch) / sid)
                    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {session.token}"}
                    cpu = await _round(client, f"{session.base_url}/chat/completions", headers, raw, requests)
                    gateway.close_session(session)
                    if r:
                        through.append(cpu)
    finally:
        await gateway.stop()
        await model.stop()
    d, g = statistics.median(direct), statistics.median(through)
    print(
        f"{requests} chat requests of {len(raw) / 1024:.0f} KB ({'streamed' if stream else 'whole'} answers) "
        f"x {rounds} rounds: the process's CPU per request {d * 1e3:.2f} ms direct, {g * 1e3:.2f} ms through "
        f"the gateway: the gateway's own {(g - d) * 1e3:.2f} ms a request"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--kb", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.kb, args.rounds, args.stream))
