"""The generated parts of docs/ match the code they are generated from, and the docs stay inside the
repository."""

from __future__ import annotations

import re
import shutil
import subprocess

from executor.docs import GENERATED, REPO, stale


def test_every_generated_part_of_the_docs_is_what_the_code_renders_now():
    assert stale() == [], "run `python -m executor.docs` and commit the result"


def test_a_stale_generated_part_or_page_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    for page, _ in GENERATED:
        shutil.copy(REPO / page, tmp_path / page)
    assert stale(tmp_path) == []
    failures = tmp_path / "docs" / "failures.md"
    failures.write_text(failures.read_text().replace("| `agent_timeout` |", "| `agent_timed_out` |"))
    schema = tmp_path / "docs" / "schema.md"
    schema.write_text(schema.read_text().replace("`model_calls`", "`model_attempts`"))
    assert stale(tmp_path) == ["docs/failures.md", "docs/schema.md"]


def test_nothing_in_the_repository_points_outside_it():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    outside = re.compile(r"\.\./shared|shared/(reference|sketches|DESIGN)|DESIGN\.md")
    hits = []
    for name in tracked:
        path = REPO / name
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ""} or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if outside.search(line) and name != "tests/test_docs.py":
                hits.append(f"{name}:{number}")
    assert hits == []
