"""The parts of ``docs/`` that are generated from the code's own tables, so a document cannot drift from
the behaviour it describes: whole pages (the row's schema) and parts between two markers in a hand-written
page (the failure kinds);
``python -m executor.docs`` rewrites them and ``tests/test_docs.py`` fails while any is stale."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from executor.row import schema_markdown
from policy.outcome import KIND_INFO, FailureKind
from policy.rules import DEFAULT_RULES, FinalAs, Rule

REPO = Path(__file__).resolve().parents[1]


def _rule_text(rule: Rule) -> str:
    final = "accepted" if rule.final is FinalAs.ACCEPT else "masked"
    if rule.retry:
        text = f"retried ({rule.max_attempts} attempts in all), then {final}"
    else:
        text = final
    if rule.grade:
        text = f"graded, {text}"
    if rule.stop_run:
        text += "; the run stops with one line"
    return text


def failure_kind_table() -> str:
    """Every failure kind: the status it implies, whether it is the infrastructure's, the default rule."""
    lines = [
        "| kind | status | infrastructure | when | default |",
        "|---|---|---|---|---|",
    ]
    for kind in FailureKind:
        info = KIND_INFO[kind]
        status = info.status.value if info.status else "as the session's"
        infra = "yes" if info.infrastructure else "no"
        lines.append(
            f"| `{kind.value}` | {status} | {infra} | {info.meaning} | {_rule_text(DEFAULT_RULES[kind])} |"
        )
    return "\n".join(lines)


# (page, part name) -> the function that renders the part; no part name: the renderer writes the whole page.
GENERATED: dict[tuple[str, str | None], Callable[[], str]] = {
    ("docs/failures.md", "failure-kinds"): failure_kind_table,
    ("docs/schema.md", None): schema_markdown,
}


def _markers(part: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- generated: {re.escape(part)} .*?-->\n)(.*?)(<!-- end generated: {re.escape(part)} -->)",
        re.DOTALL,
    )


def replace_part(text: str, part: str, content: str, where: str) -> str:
    """``text`` with the generated part named ``part`` holding ``content``; ``where`` names the page in
    the error when the page has no such part."""
    pattern = _markers(part)
    if not pattern.search(text):
        raise ValueError(f"{where}: no generated part named {part!r} between its two markers")
    return pattern.sub(lambda m: m.group(1) + content + "\n" + m.group(3), text, count=1)


def render(root: Path = REPO) -> dict[Path, tuple[str, str]]:
    """Each page with generated parts: (its text now, its text with every part rendered afresh)."""
    pages: dict[Path, tuple[str, str]] = {}
    for (page, part), renderer in GENERATED.items():
        path = root / page
        if path not in pages:
            text = path.read_text()
            pages[path] = (text, text)
        current, fresh = pages[path]
        fresh = renderer() if part is None else replace_part(fresh, part, renderer(), page)
        pages[path] = (current, fresh)
    return pages


def stale(root: Path = REPO) -> list[str]:
    """The pages whose generated parts differ from what the code renders now."""
    return sorted(str(path.relative_to(root)) for path, (now, fresh) in render(root).items() if now != fresh)


def main() -> int:
    for path, (now, fresh) in render().items():
        if now != fresh:
            path.write_text(fresh)
            print(f"rewrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
