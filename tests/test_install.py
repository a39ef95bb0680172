"""harnesses/install.py: the versioned npm install cache, with a stand-in npm and with the real one."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harnesses.install import (
    MARKER_NAME,
    OUTPUT_TAIL_CHARS,
    InstallError,
    default_cache_root,
    npm_install,
    npm_prefix,
)

pytestmark = pytest.mark.timeout(120)

# A stand-in for npm: records each call, then lays out node_modules/.bin/<bin> the way npm would, or
# fails loudly when the requested version is "0.0.0-missing".
FAKE_NPM = r"""#!{python}
import json, os, sys
argv = sys.argv[1:]
prefix = argv[argv.index("--prefix") + 1]
specs = argv[argv.index("--") + 1:]
with open(os.environ["FAKE_NPM_LOG"], "a") as log:
    log.write(json.dumps({{"argv": argv, "cache": os.environ.get("npm_config_cache"),
                          "notifier": os.environ.get("npm_config_update_notifier")}}) + "\n")
if any(spec.endswith("@0.0.0-missing") for spec in specs):
    sys.stdout.write("npm verbose noise\n" * 2000)
    sys.stdout.write("npm error notarget No matching version found\n")
    sys.exit(1)
bin_dir = os.path.join(prefix, "node_modules", ".bin")
os.makedirs(bin_dir, exist_ok=True)
tool = os.path.join(bin_dir, "tool")
with open(tool, "w") as f:
    f.write("#!/bin/sh\necho tool ran\n")
os.chmod(tool, 0o755)
"""


@pytest.fixture
def fake_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    npm = bin_dir / "npm"
    npm.write_text(FAKE_NPM.format(python=sys.executable))
    npm.chmod(npm.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "npm-calls.jsonl"
    log.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NPM_LOG", str(log))
    return log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def cache_entries(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "npm").iterdir() if p.name not in (".locks",))


def test_installs_once_and_reuses(tmp_path: Path, fake_npm: Path) -> None:
    cache = tmp_path / "cache"
    binary = npm_install(cache, "@scope/tool", "1.2.3", "tool")
    assert binary == npm_prefix(cache, "@scope/tool", "1.2.3") / "node_modules" / ".bin" / "tool"
    assert subprocess.run([binary], capture_output=True, text=True, check=True).stdout == "tool ran\n"
    assert (binary.parents[2] / MARKER_NAME).is_file()
    assert npm_install(cache, "@scope/tool", "1.2.3", "tool") == binary
    [call] = calls(fake_npm)
    assert call["argv"][-1] == "@scope/tool@1.2.3"
    assert "--ignore-scripts" in call["argv"] and "--no-save" in call["argv"]
    assert call["cache"].startswith(str(cache)) and call["notifier"] == "false"
    assert cache_entries(cache) == ["scope+tool@1.2.3"]


def test_scripts_and_extra_packages_are_passed(tmp_path: Path, fake_npm: Path) -> None:
    npm_install(tmp_path / "c", "tool", "2.0.0", "tool", {"helper": "0.1.0"}, scripts=True)
    [call] = calls(fake_npm)
    assert "--ignore-scripts" not in call["argv"]
    assert call["argv"][-2:] == ["tool@2.0.0", "helper@0.1.0"]


def test_concurrent_threads_install_once(tmp_path: Path, fake_npm: Path) -> None:
    cache = tmp_path / "cache"
    start = threading.Barrier(8)

    def install() -> Path:
        start.wait(timeout=30)
        return npm_install(cache, "tool", "1.0.0", "tool")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: install(), range(8)))
    assert len(set(results)) == 1
    assert len(calls(fake_npm)) == 1
    assert [n for n in cache_entries(cache) if n.startswith("tool")] == ["tool@1.0.0"]


def _install_in_child(cache: str) -> str:
    return str(npm_install(Path(cache), "tool", "1.0.0", "tool"))


def test_concurrent_processes_install_once(tmp_path: Path, fake_npm: Path) -> None:
    cache = tmp_path / "cache"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.map(_install_in_child, [str(cache)] * 4)
    assert len(set(results)) == 1
    assert len(calls(fake_npm)) == 1
    assert not [n for n in cache_entries(cache) if n.startswith(".tmp-")]


def test_failure_raises_one_line_and_leaves_nothing(tmp_path: Path, fake_npm: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(InstallError) as info:
        npm_install(cache, "tool", "0.0.0-missing", "tool")
    err = info.value
    assert "\n" not in err.message and "exit code 1" in err.message
    assert err.message.endswith("npm error notarget No matching version found")
    assert len(err.output_tail) <= OUTPUT_TAIL_CHARS
    assert err.output_tail.endswith("No matching version found")
    assert [n for n in cache_entries(cache) if n.startswith(("tool", ".tmp-"))] == []
    assert not npm_prefix(cache, "tool", "0.0.0-missing").exists()


def test_debris_of_a_crashed_install_is_replaced(tmp_path: Path, fake_npm: Path) -> None:
    cache = tmp_path / "cache"
    prefix = npm_prefix(cache, "tool", "1.0.0")
    (prefix / "node_modules").mkdir(parents=True)  # renamed into place, but the marker never written
    stale = prefix.parent / ".tmp-tool@1.0.0~crashed"
    stale.mkdir()
    other = prefix.parent / ".tmp-tool@1.0.0.1~in-progress"  # another version's install: left alone
    other.mkdir()
    binary = npm_install(cache, "tool", "1.0.0", "tool")
    assert binary.exists() and not stale.exists() and other.exists()
    assert len(calls(fake_npm)) == 1


def test_missing_binary_is_an_install_error(tmp_path: Path, fake_npm: Path) -> None:
    with pytest.raises(InstallError, match="no executable 'nope'"):
        npm_install(tmp_path / "c", "tool", "1.0.0", "nope")
    assert not npm_prefix(tmp_path / "c", "tool", "1.0.0").exists()


@pytest.mark.parametrize(
    ("package", "version"),
    [("../evil", "1.0.0"), ("tool", "../../x"), ("tool", "--global"), ("Tool Name", "1"), ("tool", "")],
)
def test_names_that_could_escape_the_cache_are_refused(tmp_path: Path, package: str, version: str) -> None:
    with pytest.raises(ValueError):
        npm_install(tmp_path, package, version, "tool")


def test_default_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path))
    assert default_cache_root() == tmp_path
    monkeypatch.delenv("ROLLOUT_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "rollout-executor"


# --- the real npm and the real registry ------------------------------------------------------------------


@pytest.mark.integration
def test_real_npm_concurrent_installs(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.starmap(
            npm_install, [(cache, "semver", "7.6.3", "semver", None, 300)] * 4, chunksize=1
        )
    assert len(set(results)) == 1
    binary = Path(results[0])
    assert (binary.parents[2] / MARKER_NAME).is_file()
    assert [n for n in cache_entries(cache) if not n.startswith(".npm")] == ["semver@7.6.3"]
    ran = subprocess.run([binary, "-i", "minor", "1.2.3"], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "1.3.0"


@pytest.mark.integration
def test_real_npm_missing_version(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(InstallError) as info:
        npm_install(cache, "semver", "0.0.0-does-not-exist", "semver", timeout_s=300)
    assert "\n" not in info.value.message and "No matching version" in info.value.message
    assert 0 < len(info.value.output_tail) <= OUTPUT_TAIL_CHARS
    assert [n for n in cache_entries(cache) if not n.startswith(".npm")] == []
