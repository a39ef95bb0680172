"""The Ray side of rollout-executor. A trainer's entry point is ``Executor`` (``executor/api.py``,
docs/training.md); ``RunConfig`` and ``load_config`` describe a run; ``Task`` is one task."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor.api import Executor
    from executor.config import RunConfig, load_config
    from executor.driver_types import RunSummary
    from executor.tasks import Task

# Imported when first named: `rollout status` and the other commands import this package without
# paying for Ray, which the API's driver imports.
_EXPORTS = {
    "Executor": "executor.api",
    "RunConfig": "executor.config",
    "load_config": "executor.config",
    "RunSummary": "executor.driver",
    "Task": "executor.tasks",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Executor", "RunConfig", "RunSummary", "Task", "load_config"]
