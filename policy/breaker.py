"""The run-wide circuit breaker: stop a run whose failures say every further session is wasted."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field, model_validator


class BreakerConfig(BaseModel):
    """Bounds past which the run aborts; ``null`` turns a bound off."""

    model_config = ConfigDict(extra="forbid")

    window: int = Field(default=100, ge=1, le=1_000_000)  # the last N final rows
    # The window must hold this many final rows before the fraction counts, so 1 masked of 2 is no abort.
    min_rows: int = Field(default=20, ge=1)
    max_masked_fraction: float | None = Field(default=0.5, gt=0, le=1)
    # Attempts in a row (retries included) failing for an infrastructure reason: an endpoint or a provider
    # that is down fails every session the same way, and retrying them only hides it.
    max_consecutive_infra: int | None = Field(default=50, ge=1)

    @model_validator(mode="after")
    def _fits(self) -> BreakerConfig:
        if self.min_rows > self.window:
            raise ValueError(f"min_rows ({self.min_rows}) cannot exceed window ({self.window})")
        return self


class CircuitBreaker:
    """Fed every attempt and every final row; ``tripped`` holds the one-line reason once a bound is passed."""

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self._window: deque[bool] = deque(maxlen=config.window)
        self.consecutive_infra = 0
        self.tripped: str | None = None

    @property
    def masked_fraction(self) -> float | None:
        if not self._window:
            return None
        return sum(self._window) / len(self._window)

    def record_attempt(self, infrastructure: bool, kind: str) -> str | None:
        self.consecutive_infra = self.consecutive_infra + 1 if infrastructure else 0
        self._check_infra(kind)
        return self.tripped

    def record_final(self, masked: bool) -> str | None:
        self._window.append(masked)
        self._check_window()
        return self.tripped

    def restore(self, newest_first: Iterable[tuple[bool, str, bool, bool]]) -> str | None:
        """Take the state the rows a run already wrote leave, so a resume does not start empty.

        ``newest_first``: (infrastructure, kind, final, masked) per row, from the last written back;
        it is read only as far as the window's final rows and the infrastructure failures that end the
        run reach. The bounds are then checked once, on that state: a run that stopped at a bound stops
        again, one resumed under a looser bound goes on.
        """
        masked_newest: list[bool] = []
        streak, streak_open, last_kind = 0, True, ""
        for infrastructure, kind, final, masked in newest_first:
            if streak_open and infrastructure:
                streak += 1
                last_kind = last_kind or kind
            else:
                streak_open = False
            if final and len(masked_newest) < self.config.window:
                masked_newest.append(masked)
            if not streak_open and len(masked_newest) == self.config.window:
                break
        self._window.clear()
        self._window.extend(reversed(masked_newest))
        self.consecutive_infra, self.tripped = streak, None
        self._check_infra(last_kind)
        self._check_window()
        return self.tripped

    def _check_infra(self, kind: str) -> None:
        bound = self.config.max_consecutive_infra
        if bound is not None and self.consecutive_infra >= bound and self.tripped is None:
            self.tripped = (
                f"circuit breaker: {self.consecutive_infra} consecutive infrastructure failures "
                f"(last: {kind}) reached the bound of {bound}"
            )

    def _check_window(self) -> None:
        bound = self.config.max_masked_fraction
        fraction = self.masked_fraction
        if (
            bound is not None
            and fraction is not None
            and len(self._window) >= self.config.min_rows
            and fraction > bound
            and self.tripped is None
        ):
            self.tripped = (
                f"circuit breaker: {sum(self._window)} of the last {len(self._window)} final rows "
                f"masked ({fraction:.0%}), above the bound of {bound:.0%}"
            )

    def report(self) -> dict[str, object]:
        return {
            "tripped": self.tripped,
            "window_rows": len(self._window),
            "window_masked": sum(self._window),
            "consecutive_infra": self.consecutive_infra,
        }
