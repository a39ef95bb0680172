"""The ``rollout`` commands that check and measure rollout itself: ``conformance`` (every scenario against
every harness), ``bench`` (the figures of docs/performance.md) and ``model serve`` (the scripted model).
executor/cli.py registers them beside the others."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from executor.task import InputError

console = Console()


def _fail_input(message: str) -> None:
    """As executor/cli.py says bad input: one line, exit 2."""
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def conformance(
    harness: Annotated[str, typer.Option(help="A harness name, or 'all'.")] = "all",
    version: Annotated[
        list[str] | None,
        typer.Option(help="V (one harness), NAME=V (repeatable), or nemo-gym (NeMo Gym's versions)."),
    ] = None,
    scenario: Annotated[list[str] | None, typer.Option(help="Only this scenario; repeatable.")] = None,
    out: Annotated[Path, typer.Option(help="Where conformance.md/.json and each cell's rows go.")] = Path(
        "runs/conformance"
    ),
    concurrency: Annotated[int, typer.Option(min=1, max=64, help="Cells running at once.")] = 4,
    network: Annotated[
        str, typer.Option(help="isolated (a loopback-only network namespace), host, or auto.")
    ] = "auto",
    provider: Annotated[str, typer.Option(help="local, or container (with --image).")] = "local",
    image: Annotated[str | None, typer.Option(help="--provider container: the image cells run in.")] = None,
    container_config: Annotated[
        Path | None,
        typer.Option(help="--provider container: a YAML sandbox section (engine, runtime, ulimits...)."),
    ] = None,
) -> None:
    """Every scenario against every harness through the real executor path; writes the matrix."""
    import asyncio

    from executor.testing.conformance import (
        container_config as read_container_config,
    )
    from executor.testing.conformance import network_mode, parse_scenarios, parse_targets, run_matrix

    try:
        targets = parse_targets(harness, version or [])
        scenarios = parse_scenarios(scenario or [])
        network_mode(network)
        container = read_container_config(provider, image, container_config)
    except InputError as exc:
        _fail_input(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    matrix = asyncio.run(
        run_matrix(
            targets, scenarios, out.resolve(), concurrency=concurrency, network=network, container=container
        )
    )
    passed = sum(c.passed for c in matrix.cells)
    for cell in matrix.cells:
        if not cell.passed:
            line = f"FAIL {cell.harness} {cell.version} {cell.scenario}: {cell.first_failure}"
            console.print(line, highlight=False, soft_wrap=True)
    console.print(
        f"{passed}/{len(matrix.cells)} cells pass in {matrix.wall_s:.1f}s -> {out / 'conformance.md'}",
        highlight=False,
    )
    raise typer.Exit(0 if matrix.passed else 1)


def bench(
    parts: Annotated[str, typer.Option(help="Which comparisons: any of a, b, c, d, e, f, g.")] = "abcd",
    runs: Annotated[int, typer.Option(help="(a) sequential Codex rollouts per side.")] = 20,
    null_rollouts: Annotated[int, typer.Option(help="(b) null rollouts per concurrency level.")] = 512,
    memory_rollouts: Annotated[int, typer.Option(help="(c) N: driver RSS at N and 10*N rollouts.")] = 10_000,
    store_rows: Annotated[int, typer.Option(help="(d) rows appended, then resume-scanned.")] = 100_000,
    store_out: Annotated[
        str | None, typer.Option(help="(d) where the rows go: a path or URI (s3://...); default local disk.")
    ] = None,
    token_ids: Annotated[
        int, typer.Option(help="(c) token ids per model call in each row, as with gateway.capture_tokens.")
    ] = 0,
    cold_runs: Annotated[
        int, typer.Option(min=1, help="(e) cold `rollout run`s, each in a fresh process.")
    ] = 5,
    cold_rollouts: Annotated[int, typer.Option(min=1, help="(e) one-tool Codex rollouts per cold run.")] = 10,
    cold_concurrency: Annotated[int, typer.Option(min=1, help="(e) sessions at once in a cold run.")] = 1,
    scale_sessions: Annotated[
        int, typer.Option(min=1, max=100_000, help="(f) sessions of a sleeping null harness, all at once.")
    ] = 1000,
    scale_workers: Annotated[int, typer.Option(min=1, max=1000, help="(f) worker actors.")] = 8,
    scale_sleep: Annotated[
        float, typer.Option(min=0, max=3600, help="(f) seconds each session sleeps.")
    ] = 30.0,
    scale_fixed: Annotated[
        bool,
        typer.Option(
            help="(f) first one session per worker: the CPU per session beyond the run's fixed costs."
        ),
    ] = False,
    scale_nodes: Annotated[
        int,
        typer.Option(
            min=0, max=64, help="(f) raylets of this machine (`ray start`) the workers spread over; 0: one."
        ),
    ] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the figures here.")] = None,
    markdown_out: Annotated[
        Path | None,
        typer.Option("--markdown", help="Also write the figures as tables into this page's 'bench' part."),
    ] = None,
    provider: Annotated[
        str, typer.Option(help="(a) local, or container (with --image); (g) its container.")
    ] = "local",
    image: Annotated[str | None, typer.Option(help="(a) --provider container: the image.")] = None,
    container_config: Annotated[
        Path | None, typer.Option(help="(a) --provider container: a YAML sandbox section.")
    ] = None,
    isolation: Annotated[
        str | None, typer.Option(help="(a) sandbox.isolation of the executor's side: auto, strict or off.")
    ] = None,
) -> None:
    """Measure what the executor itself costs, side by side with doing without it."""
    import json

    from executor.docs import replace_part
    from executor.testing.bench import markdown, run_all
    from executor.testing.conformance import container_config as read_container_config

    try:
        container = read_container_config(provider, image, container_config)
    except InputError as exc:
        _fail_input(str(exc))

    if markdown_out is not None:
        try:  # before hours of measuring, not after
            page = markdown_out.read_text()
            replace_part(page, "bench", "", str(markdown_out))
        except (OSError, ValueError) as exc:
            _fail_input(f"--markdown {markdown_out}: {exc}")

    if not set(parts) <= set("abcdefg") or not parts:
        _fail_input(f"--parts {parts!r}: use letters from 'abcdefg'")
    if token_ids < 0:
        _fail_input(f"--token-ids {token_ids}: must be 0 or more")
    if isolation not in (None, "auto", "strict", "off"):
        _fail_input(f"--isolation {isolation!r}: use auto, strict or off")
    figures = run_all(
        parts,
        runs,
        null_rollouts,
        memory_rollouts,
        store_rows,
        echo=console.print,
        token_ids=token_ids,
        cold_runs=cold_runs,
        cold_rollouts=cold_rollouts,
        cold_concurrency=cold_concurrency,
        container=container,
        scale=(scale_sessions, scale_workers, scale_sleep),
        scale_fixed=scale_fixed,
        scale_nodes=scale_nodes,
        isolation=isolation,
        store_out=store_out,
    )
    if json_out:
        json_out.write_text(json.dumps(figures, indent=2))
    if markdown_out is not None:
        import os
        import time

        command = "rollout bench " + " ".join(sys.argv[2:])
        when = time.strftime("%Y-%m-%d", time.gmtime())
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        machine = f"{os.cpu_count()} cores, {memory_gib:.0f} GiB"
        tables = markdown(figures, command, when, machine)
        markdown_out.write_text(replace_part(markdown_out.read_text(), "bench", tables, str(markdown_out)))


def model_serve(
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8700,
    script: Annotated[
        Path | None,
        typer.Option(
            help="JSON list of steps, played from its start to each session: a /s/<key>/v1 base URL or an "
            "x-rollout-session header (a run's gateway sends it on every request) names one; requests with "
            "neither share one session, and so one position in the script."
        ),
    ] = None,
) -> None:
    """Serve the scripted OpenAI-compatible model (Chat Completions and Responses)."""
    from harnesses.testing.scripted_model import serve

    serve(host, port, str(script) if script else None)
