"""Harness name -> adapter, with an error that lists the valid names."""

from __future__ import annotations

from collections.abc import Callable

from harnesses.base import Harness


def _codex(version: str | None) -> Harness:
    from harnesses.codex import CodexHarness

    return CodexHarness(version)


def _command(version: str | None) -> Harness:
    from harnesses.command import CommandHarness

    return CommandHarness(version)


def _opencode(version: str | None) -> Harness:
    from harnesses.opencode import OpenCodeHarness

    return OpenCodeHarness(version)


def _hermes(version: str | None) -> Harness:
    from harnesses.hermes import HermesHarness

    return HermesHarness(version)


def _pi(version: str | None) -> Harness:
    from harnesses.pi import PiHarness

    return PiHarness(version)


HARNESSES: dict[str, Callable[[str | None], Harness]] = {"codex": _codex, "command": _command}
HARNESSES["opencode"] = _opencode
HARNESSES["pi"] = _pi
HARNESSES["hermes"] = _hermes


def make_harness(name: str, version: str | None = None, command: str | None = None) -> Harness:
    try:
        factory = HARNESSES[name]
    except KeyError:
        raise ValueError(f"unknown harness {name!r}; known: {', '.join(sorted(HARNESSES))}") from None
    if command is not None:
        from harnesses.command import CommandHarness

        if name != "command":
            raise ValueError(f"harness.command applies to the 'command' harness, not {name!r}")
        return CommandHarness(version, command)
    return factory(version)
