"""Harness name -> adapter class, as one literal table; an adapter's module is imported only when used,
so the driver never pays for adapters it does not run."""

from __future__ import annotations

from importlib import import_module

from harnesses.base import Harness

# name -> "module:Class". Adding a harness is one line here and one module (docs/adding-a-harness.md).
HARNESSES: dict[str, str] = {
    "codex": "harnesses.codex:CodexHarness",
    "opencode": "harnesses.opencode:OpenCodeHarness",
    "pi": "harnesses.pi:PiHarness",
    "hermes": "harnesses.hermes:HermesHarness",
    "command": "harnesses.command:CommandHarness",  # any shell command as the agent; no model adapter
}


def make_harness(name: str, version: str | None = None, command: str | None = None) -> Harness:
    try:
        module, _, cls = HARNESSES[name].partition(":")
    except KeyError:
        raise ValueError(f"unknown harness {name!r}; known: {', '.join(sorted(HARNESSES))}") from None
    adapter = getattr(import_module(module), cls)
    if command is not None:
        if name != "command":
            raise ValueError(f"harness.command applies to the 'command' harness, not {name!r}")
        return adapter(version, command)
    return adapter(version)
