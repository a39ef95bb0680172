"""The ``rollout`` command line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from executor.cli_dev import bench, conformance, model_serve
from executor.tasks import InputError

if TYPE_CHECKING:
    from executor.config import RunConfig
    from executor.storage import Location

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
    no_preflight: Annotated[
        bool, typer.Option("--no-preflight", help="Skip the endpoint check made before any sandbox starts.")
    ] = False,
    preflight_timeout: Annotated[
        float, typer.Option(min=0.5, max=600, help="Seconds the endpoint check may take in all.")
    ] = 20.0,
    address: Annotated[
        str | None,
        typer.Option(
            help="Ray cluster to join (HOST:PORT, auto, ray://...); 'local' starts one of the run's own. "
            "Overrides the config's ray_address, which overrides RAY_ADDRESS; with none of the three the "
            "run starts a local cluster of its own, whatever else runs on this machine."
        ),
    ] = None,
) -> None:
    """Run (or resume) the rollouts a config describes."""
    from executor import phases
    from executor.cluster import check_out
    from executor.config import load_config, local_path
    from executor.schema import refuse_pandas
    from executor.storage import check_writable, is_object_uri, locate

    phases.mark("cli")
    refuse_pandas()

    overrides: dict[str, object] = {}
    for key, value in (
        ("tasks", tasks),
        ("out", out),
        ("run_id", run_id),
        ("samples", samples),
        ("model.name", model),
        ("model.api_key_env", api_key_env),
        ("concurrency.max_in_flight", max_in_flight),
        ("ray_address", address),
    ):
        if value is not None:
            overrides[key] = value
    if model_url:
        overrides["model.provider"] = "openai"
        overrides["model.base_url"] = model_url
    try:
        for key in ("tasks", "out"):
            if key in overrides:
                given = local_path(str(overrides[key]), f"--{key}", objects_ok=key == "out")
                overrides[key] = given if is_object_uri(given) else str(Path(given).resolve())
        cfg = load_config(config, overrides)
        check_out(cfg.out)  # before anything is written: not where Ray deletes it after the job
        if is_object_uri(cfg.out):  # a missing bucket, an endpoint not reached, keys refused: now
            check_writable(locate(cfg.out) / (cfg.run_id or ""))
        cfg.model.api_key()
        if cfg.tasks is None:
            raise InputError(f"{config}: tasks: a task file is required (or give --tasks)")
        _validate_tasks(Path(cfg.tasks))
    except InputError as exc:
        _fail_input(str(exc))
    phases.mark("config")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from executor.api import Executor
    from executor.runs import RunLockedError, check_free

    try:
        # Before Ray starts: a run another driver holds is refused at once, with nothing started.
        check_free(locate(cfg.out) / (cfg.run_id or ""))
        _start(cfg, None if no_preflight else preflight_timeout)
        summary = Executor(cfg, exiting=True, progress=True).run()
    except RunLockedError as exc:
        from rich.markup import escape

        _fail_input(escape(str(exc)))  # another driver holds the run: nothing was written
    _print_counts(summary.run_dir)
    if summary.stopped:
        Console(stderr=True).print(
            f"[bold red]run stopped:[/] {summary.stopped}", highlight=False, soft_wrap=True
        )
    console.print(
        f"rows: {summary.rows}  final: {summary.final}  pending: {summary.pending}  -> {summary.run_dir}",
        highlight=False,
    )
    _exit_when_done(summary.exit_code)


def _exit_when_done(code: int) -> None:
    """Exit with ``code`` once the run is done: rows durable, sandboxes stopped, summary written and
    printed, the cluster we started stopped or the warm executor let go of. The exit handlers run as
    usual (logging, finalizers); only the interpreter's teardown, ~0.2-0.4 s of freeing what the
    process's end frees anyway, is skipped. A driver that let go of a warm executor also skips Ray's
    disconnect (``executor.driver.leave_ray``): its process's end closes the connection. A joined
    cluster (Ray still connected: its disconnect tells the cluster our job ended) or a thread the
    ordinary exit would wait for (not a daemon) gets the ordinary exit."""
    import atexit
    import os
    import threading

    import ray

    from executor.driver import left_connected

    main = threading.main_thread()
    if any(t is not main and not t.daemon for t in threading.enumerate()):
        raise typer.Exit(code)
    if left_connected():
        atexit.unregister(ray.shutdown)
    elif ray.is_initialized():
        raise typer.Exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start(cfg: RunConfig, preflight_timeout_s: float | None) -> None:
    """Start Ray (or join the configured cluster) while the endpoint is checked and the harness install
    is: each can take seconds cold, none needs the others. Nothing of the run is written yet, so a check
    that fails stops the cluster started for it and leaves nothing behind."""
    from concurrent.futures import ThreadPoolExecutor

    from executor import capacity, phases
    from executor.driver import connect_ray, leave_ray

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="rollout-check") as pool:
        # The scripted model is no endpoint of the user's: no URL, key or model name of theirs to get
        # wrong, and each worker starts its own. Checking one started here only costs its imports.
        check = bool(preflight_timeout_s) and cfg.model.provider != "scripted"
        checked = pool.submit(_preflight, cfg, preflight_timeout_s) if check else None
        harness = pool.submit(_ensure_harness, cfg)
        own = connect_ray(cfg)  # in this thread: Ray sets its signal handlers from the main thread only
        phases.mark("ray_up")
        try:
            try:
                capacity.check(cfg.concurrency.worker_resources, cfg.concurrency.workers)
            except InputError as exc:
                _fail_input(str(exc))
            if checked is not None:
                checked.result()
            phases.mark("preflight")
            harness.result()
        except typer.Exit:
            leave_ray(own, [])
            raise
    phases.mark("harness")


def _preflight(cfg: RunConfig, timeout_s: float) -> None:
    """Check the endpoint before anything is written: a wrong URL, key or model would fail every
    session alike. One line and exit code 2 when it would."""
    from rich.markup import escape

    from executor.preflight import PreflightError, preflight

    try:
        result = preflight(cfg, timeout_s)
    except PreflightError as exc:
        _fail_input(escape(exc.line))  # the endpoint's words may hold [brackets]: not markup
    if result.warning:
        Console(stderr=True).print(
            f"[yellow]warning:[/] {escape(result.warning)}", highlight=False, soft_wrap=True
        )


def _validate_tasks(path: Path) -> None:
    from executor.tasks import load_tasks

    count = sum(1 for _ in load_tasks(path))
    if count == 0:
        raise InputError(f"{path}: no tasks")


RUN_DIR_HELP = "A run directory (OUT/RUN_ID): a path, or a URI (s3://BUCKET/runs/RUN_ID)."


def _run_dir(value: str) -> Location:
    """The run directory ``value`` names, with rows in it; else one line and exit 2."""
    from executor.storage import describe_error, locate

    try:
        found = locate(value)
        if (found / "rows").is_dir():
            return found
    except InputError as exc:
        _fail_input(str(exc))
    except OSError as exc:  # an object store not reached, or refusing us
        _fail_input(f"{value}: cannot read it ({describe_error(exc)})")
    _fail_input(f"{value}: not a run directory (no rows/ inside)")
    raise AssertionError  # _fail_input exits


@app.command()
def status(
    run_dir: Annotated[str, typer.Argument(help=RUN_DIR_HELP)],
    slowest: Annotated[int, typer.Option(min=0, max=1000, help="How many slowest rollouts to list.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print the numbers as one JSON object.")] = False,
) -> None:
    """Tables by status, failure kind, harness and provider; retries, masks, the slowest rollouts.

    Reads the part files written so far, so it works while the run is going."""
    import json

    from executor.status import print_status, status_data

    data = status_data(_run_dir(run_dir), slowest=slowest)
    if as_json:
        print(json.dumps(data))
    else:
        print_status(data, console)


def _print_counts(run_dir: str) -> None:
    from executor.status import counts_table, status_data

    console.print(counts_table(status_data(run_dir, slowest=0)))


def _ensure_harness(cfg: RunConfig) -> None:
    """Install the harness before the run starts, saying so when it was not in the cache yet."""
    from concurrent.futures import ThreadPoolExecutor

    from harnesses.install import InstallError, default_cache_root
    from harnesses.registry import make_harness

    harness = make_harness(cfg.harness.name, cfg.harness.version, cfg.harness.command)
    cache = default_cache_root()
    err = Console(stderr=True)
    with ThreadPoolExecutor(max_workers=1) as pool:
        job = pool.submit(harness.ensure_installed, cache)
        try:
            job.result(timeout=1.0)  # an installed harness answers in milliseconds
        except TimeoutError:
            err.print(
                f"harness {harness.name} {harness.version} is not in the cache yet: installing it into "
                f"{cache} now (once; later runs and sessions reuse it; set ROLLOUT_CACHE to move the cache)",
                highlight=False,
                soft_wrap=True,
            )
        except InstallError:
            pass  # reported below, with the installer's output
        try:
            job.result()
        except InstallError as exc:
            err.print(
                f"[bold red]error:[/] harness {harness.name} {harness.version} could not be installed: "
                f"{exc.message}",
                highlight=False,
                soft_wrap=True,
            )
            if exc.output_tail:
                err.print("--- installer output (tail) ---", highlight=False)
                err.print(exc.output_tail, highlight=False, markup=False, soft_wrap=True)
            raise typer.Exit(1) from None


@app.command()
def runs(
    out_root: Annotated[
        str, typer.Argument(help="An output root holding run directories: a path, or s3://BUCKET/runs.")
    ] = "runs",
) -> None:
    """The runs under OUT_ROOT with their state (running, complete, stopped, ...) and counts."""
    import datetime

    from executor.runs import list_runs
    from executor.storage import describe_error, locate

    try:
        root = locate(out_root)
        if not root.is_dir():
            _fail_input(f"{out_root}: no such directory")
        found = list_runs(root)
    except InputError as exc:
        _fail_input(str(exc))
    except OSError as exc:
        _fail_input(f"{out_root}: cannot read it ({describe_error(exc)})")
    if not found:
        console.print(f"{out_root}: no runs", highlight=False)
        return
    table = Table(title=str(out_root), box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("run", "state", "rows", "final", "accept", "mask", "retry", "pending", "updated UTC"):
        justify = "left" if name in ("run", "state", "updated UTC") else "right"
        table.add_column(name, justify=justify, no_wrap=True)
    for r in found:
        updated = (
            datetime.datetime.fromtimestamp(r.updated_at, datetime.UTC).strftime("%m-%d %H:%M")
            if r.updated_at
            else "-"
        )
        table.add_row(
            r.run_id,
            r.state,
            str(r.rows),
            str(r.final),
            str(r.by_decision.get("accept", 0)),
            str(r.by_decision.get("mask", 0)),
            str(r.by_decision.get("retry", 0)),
            "-" if r.pending is None else str(r.pending),
            updated,
        )
    console.print(table)


@app.command()
def report(
    run_dir: Annotated[str, typer.Argument(help=RUN_DIR_HELP)],
    out: Annotated[Path | None, typer.Option(help="HTML file to write (default RUN_DIR/report.html).")] = (
        None
    ),
) -> None:
    """One self-contained HTML file with the run's plots; nothing is fetched when it is viewed."""
    from executor.report import write_report

    try:
        path = write_report(_run_dir(run_dir), out)
    except InputError as exc:
        _fail_input(str(exc))
    console.print(f"report -> {path}", highlight=False)


@app.command()
def export(
    run_dir: Annotated[str, typer.Argument(help=RUN_DIR_HELP)],
    train: Annotated[Path, typer.Option(help="File to write (Parquet, or JSON lines with --format jsonl).")],
    fmt: Annotated[str, typer.Option("--format", help="parquet or jsonl.")] = "parquet",
    all_rows: Annotated[
        bool, typer.Option("--all", help="Every attempt with its decision columns, not just trainable rows.")
    ] = False,
) -> None:
    """Rows for a trainer: final, unmasked, accepted (or --all), in the documented export schema."""
    from executor.export import export as write_export

    if fmt not in ("parquet", "jsonl"):
        _fail_input(f"--format: {fmt!r} is not one of parquet, jsonl")
    try:
        rows = write_export(_run_dir(run_dir), train, fmt, include_all=all_rows)  # type: ignore[arg-type]
    except InputError as exc:
        _fail_input(str(exc))
    console.print(f"{rows} rows -> {train}", highlight=False)


@app.command()
def replay(
    run_dir: Annotated[str, typer.Argument(help=RUN_DIR_HELP)],
    rollout_id: Annotated[str, typer.Argument(help="The row's rollout id (TASK.sN.aN).")],
    model_url: Annotated[str | None, typer.Option(help="Another OpenAI-compatible endpoint (…/v1).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name to request.")] = None,
    api_key_env: Annotated[str | None, typer.Option(help="Environment variable holding the API key.")] = None,
) -> None:
    """Run one recorded rollout again, locally, with its harness version, config, task and sample.

    Prints what differs; exits 0 when status, failure kind, reward and tool calls match, 1 otherwise."""
    from executor.replay import describe_tool_calls, run_replay

    overrides: dict[str, object] = {}
    if model_url:
        overrides["model.provider"] = "openai"
        overrides["model.base_url"] = model_url
    if model:
        overrides["model.name"] = model
    if api_key_env:
        overrides["model.api_key_env"] = api_key_env
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = run_replay(_run_dir(run_dir), rollout_id, overrides)
    except InputError as exc:
        _fail_input(str(exc))
    table = Table(title=f"replay of {rollout_id}")
    for name in ("field", "recorded", "replayed", ""):
        table.add_column(name)
    for name, recorded, replayed, same in result.comparison():
        if name == "tool_calls":
            recorded, replayed = describe_tool_calls(recorded), describe_tool_calls(replayed)
        mark = "" if same is None else ("same" if same else "[bold red]DIFFERS[/]")
        table.add_row(name, str(recorded), str(replayed), mark)
    console.print(table)
    verdict = "same outcome" if result.same else f"differs in: {', '.join(result.differences)}"
    console.print(f"{verdict}; evidence -> {result.evidence_dir}", highlight=False)
    raise typer.Exit(0 if result.same else 1)


app.command()(conformance)
app.command()(bench)


@app.command()
def gc(
    config: Annotated[Path, typer.Argument(help="The run config (YAML): it names the sandbox provider.")],
    run: Annotated[str | None, typer.Option("--run", help="Only this run's sandboxes.")] = None,
    everything: Annotated[
        bool, typer.Option("--all", help="With --run: end all of them, owners alive or not.")
    ] = False,
    address: Annotated[
        str | None,
        typer.Option(help="A Ray cluster (HOST:PORT, auto): reap on every node of it, not only here."),
    ] = None,
) -> None:
    """Reap: end the sandboxes (processes, Slurm jobs, ECS tasks) that dead workers or a crashed run left,
    and remove what they left on disk (sandbox directories, laid-out workspaces, evidence scratch, gateway
    sockets, run directories left empty)."""
    from executor.config import load_config
    from executor.reaper import reap, reap_everywhere

    if everything and not run:
        _fail_input("--all needs --run RUN: it ends every sandbox of that run")
    try:
        cfg = load_config(config)
    except InputError as exc:
        _fail_input(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    failed: list[str] = []
    if address:
        import ray

        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        try:
            reaped, failed = reap_everywhere(cfg.sandbox, run, everything=everything)
        finally:
            ray.shutdown()
    else:
        reaped = reap(cfg.sandbox, run, everything=everything)
    for sandbox_id in reaped:
        console.print(f"ended {sandbox_id}", highlight=False)
    console.print(f"{cfg.sandbox.provider}: {len(reaped)} sandboxes ended", highlight=False)
    from rich.markup import escape

    for line in failed:
        Console(stderr=True).print(f"[bold red]not reaped:[/] {escape(line)}", highlight=False)
    if failed:
        raise typer.Exit(1)


@app.command()
def up(
    config: Annotated[
        Path | None,
        typer.Argument(help="A run config whose workers to warm now; without one the first run warms them."),
    ] = None,
    idle_timeout: Annotated[
        float, typer.Option(min=1, max=7 * 86400, help="Seconds without a run after which it stops itself.")
    ] = 1800.0,
) -> None:
    """Start a warm local executor: `rollout run` attaches to it in a fraction of a second."""
    from executor import warm

    cfg = None
    if config is not None:
        from executor.config import load_config

        try:
            cfg = load_config(config)
        except InputError as exc:
            _fail_input(str(exc))
    try:
        record, started = warm.up(idle_timeout)
        if cfg is not None:
            from executor.driver import worker_options
            from executor.worker import RemoteSandboxWorker

            ids = warm.prewarm(cfg, RemoteSandboxWorker, worker_options(cfg))
            console.print(f"warmed {len(ids)} workers for {config}", highlight=False)
    except (warm.WarmError, InputError) as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    state = "up" if started else "already up"
    console.print(
        f"warm executor {state}: pid {record.pid}, cluster {record.gcs_address}, stops after "
        f"{record.idle_timeout_s:.0f} s without a run; `rollout run` attaches to it, `rollout down` stops it",
        highlight=False,
    )


@app.command()
def down() -> None:
    """Stop the warm executor `rollout up` started (after the run attached to it, if one is)."""
    from executor import warm

    try:
        record = warm.down()
    except warm.WarmError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    console.print(
        f"warm executor stopped (pid {record.pid})" if record else "no warm executor was running",
        highlight=False,
    )


model_app.command("serve")(model_serve)


def main() -> None:  # pragma: no cover
    try:
        app()
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    main()
