"""Bounded staleness: what becomes of a row whose session started under a policy version the trainer has
since moved past.

An asynchronous trainer announces version after version while sessions run. A row's staleness is the
number of versions between the one its session started under and the one current when the driver
decides on it. Within ``max_versions`` a row is delivered as the policy decided it; past it, ``action``
says what it becomes: ``deliver`` (as it is, its staleness on the row for the trainer to weigh), ``mask``
(kept as evidence, never trained on) or ``rerun`` (a new attempt under the current version, within the
run's retry budget and ``max_reruns`` per sample, then masked). ``in_flight`` says what happens, when a
version is announced, to sessions that could no longer be delivered within the bound: ``finish`` lets
them run (their rows then meet ``action``), ``cancel`` stops them and starts them again under the new
version, writing nothing for the cancelled launch.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class StaleAction(StrEnum):
    DELIVER = "deliver"
    MASK = "mask"
    RERUN = "rerun"


class InFlightAction(StrEnum):
    FINISH = "finish"
    CANCEL = "cancel"


class StalenessConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_versions: int | None = Field(default=None, ge=0)  # None: no bound, every row is delivered as decided
    action: StaleAction = StaleAction.MASK
    in_flight: InFlightAction = InFlightAction.FINISH
    max_reruns: int = Field(default=2, ge=0, le=100)  # rerun: new attempts per sample for staleness alone


def staleness(started: int | None, current: int) -> int | None:
    """Versions announced between a session's start and now; None for a row with no version."""
    return None if started is None else max(current - started, 0)


def too_stale(config: StalenessConfig, started: int | None, current: int) -> bool:
    lag = staleness(started, current)
    return config.max_versions is not None and lag is not None and lag > config.max_versions


def stale_reason(started: int | None, current: int, config: StalenessConfig) -> str:
    return (
        f"stale: started under policy version {started}, decided at {current} "
        f"(at most {config.max_versions} behind)"
    )
