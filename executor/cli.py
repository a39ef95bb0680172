"""The ``rollout`` command line."""

from __future__ import annotations

import logging
import sys
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from executor.tasks import InputError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Distributed rollouts of coding-agent harnesses."
)
model_app = typer.Typer(no_args_is_help=True, help="The built-in scripted model.")
app.add_typer(model_app, name="model")
console = Console()


def _fail_input(message: str) -> None:
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="Run config (YAML).")],
    tasks: Annotated[
        str | None, typer.Option(help="Task file (JSONL or Parquet); overrides the config.")
    ] = None,
    out: Annotated[str | None, typer.Option(help="Output root; the run goes to OUT/RUN_ID.")] = None,
    run_id: Annotated[str | None, typer.Option(help="Run id; the same id resumes.")] = None,
    model_url: Annotated[str | None, typer.Option(help="A real OpenAI-compatible endpoint (…/v1).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name to request.")] = None,
    api_key_env: Annotated[str | None, typer.Option(help="Environment variable holding the API key.")] = None,
    samples: Annotated[int | None, typer.Option(help="Samples per task.")] = None,
    max_in_flight: Annotated[int | None, typer.Option(help="Sessions outstanding at once.")] = None,
) -> None:
    """Run (or resume) the rollouts a config describes."""
    from executor.config import load_config

    overrides: dict[str, object] = {}
    for key, value in (
        ("tasks", tasks),
        ("out", out),
        ("run_id", run_id),
        ("samples", samples),
        ("model.name", model),
        ("model.api_key_env", api_key_env),
        ("concurrency.max_in_flight", max_in_flight),
    ):
        if value is not None:
            overrides[key] = str(Path(value).resolve()) if key in ("tasks", "out") else value
    if model_url:
        overrides["model.provider"] = "openai"
        overrides["model.base_url"] = model_url
    try:
        cfg = load_config(config, overrides)
        cfg.model.api_key()
        _validate_tasks(Path(cfg.tasks))
    except InputError as exc:
        _fail_input(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from executor.driver import Driver

    summary = Driver(cfg).run()
    _print_counts(Path(summary.run_dir))
    if summary.stopped:
        Console(stderr=True).print(f"[bold red]run stopped:[/] {summary.stopped}", highlight=False)
    console.print(
        f"rows: {summary.rows}  final: {summary.final}  pending: {summary.pending}  -> {summary.run_dir}",
        highlight=False,
    )
    raise typer.Exit(summary.exit_code)


def _validate_tasks(path: Path) -> None:
    from executor.tasks import load_tasks

    count = sum(1 for _ in load_tasks(path))
    if count == 0:
        raise InputError(f"{path}: no tasks")


@app.command()
def status(run_dir: Annotated[Path, typer.Argument(help="A run directory (OUT/RUN_ID).")]) -> None:
    """Counts by status, failure kind and decision; works while the run is going."""
    if not (run_dir / "rows").is_dir():
        _fail_input(f"{run_dir}: not a run directory (no rows/ inside)")
    _print_counts(run_dir)


def _print_counts(run_dir: Path) -> None:
    from executor.store import read_table

    cols = read_table(
        run_dir,
        [
            "task_id",
            "sample_index",
            "status",
            "failure_kind",
            "decision",
            "final",
            "reward",
            "t_total_s",
            "rollout_id",
        ],
    ).to_pydict()
    n = len(cols["task_id"])
    final_rows = [i for i in range(n) if cols["final"][i]]
    table = Table(title=f"{run_dir.name}: {n} rows, {len(final_rows)} final")
    for name in ("status", "failure_kind", "decision", "rows", "final", "mean reward"):
        table.add_column(name, justify="right" if name in ("rows", "final", "mean reward") else "left")
    groups: Counter[tuple[str, str, str]] = Counter()
    finals: Counter[tuple[str, str, str]] = Counter()
    rewards: dict[tuple[str, str, str], list[float]] = {}
    for i in range(n):
        key = (cols["status"][i], cols["failure_kind"][i], cols["decision"][i])
        groups[key] += 1
        finals[key] += int(bool(cols["final"][i]))
        if cols["reward"][i] is not None and cols["decision"][i] == "accept":
            rewards.setdefault(key, []).append(cols["reward"][i])
    for key, count in sorted(groups.items()):
        rs = rewards.get(key)
        mean = f"{sum(rs) / len(rs):.3f}" if rs else "-"
        table.add_row(*key, str(count), str(finals[key]), mean)
    console.print(table)


@model_app.command("serve")
def model_serve(
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8700,
    script: Annotated[Path | None, typer.Option(help="JSON list of steps played to every session.")] = None,
) -> None:
    """Serve the scripted OpenAI-compatible model (Chat Completions and Responses)."""
    from harnesses.scripted_model import serve

    serve(host, port, str(script) if script else None)


def main() -> None:  # pragma: no cover
    try:
        app()
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    main()
