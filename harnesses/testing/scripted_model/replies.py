"""What the model answers, independent of the wire format: a step fitted to the tools the client offers
(a shell or write tool by whatever name it has), and the auxiliary requests that take no step."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Literal

AUX_TEXT = "Scripted test session"


# Ordered by preference: the first name the client offers wins.
_SHELL_TOOLS = (
    "exec_command",
    "shell",
    "bash",
    "terminal",
    "shell_command",
    "local_shell",
    "run_shell_command",
    "execute_command",
    "run_command",
)
_WRITE_TOOLS = ("write", "write_file", "create_file", "file_write")
_PATH_KEYS = ("path", "file_path", "filePath", "filename")
_CONTENT_KEYS = ("content", "contents", "text")


@dataclass(frozen=True)
class _Call:
    call_id: str
    name: str
    arguments: str  # JSON text, as both APIs carry it


@dataclass(frozen=True)
class _Reply:
    text: str = ""
    call: _Call | None = None
    finish_reason: Literal["stop", "length"] = "stop"
    usage: tuple[int, int] | None = None  # (input, output); None means "omit usage on the wire"


def _usage(request_bytes: int, produced: str) -> tuple[int, int]:
    # Deterministic from sizes, so tests and demos can predict token counts without a tokenizer.
    return request_bytes // 4, len(produced) // 4 + 1


def _tools(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Function tools by name with their JSON schema, from the Chat (nested) or Responses (flat) form."""
    found: dict[str, dict[str, Any]] = {}
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue
        spec = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = spec.get("name")
        if isinstance(name, str):
            params = spec.get("parameters")
            found[name] = params if isinstance(params, dict) else {}
    return found


def _pick(tools: dict[str, dict[str, Any]], preferred: tuple[str, ...]) -> str | None:
    lowered = {name.lower(): name for name in tools}
    return next((lowered[name] for name in preferred if name in lowered), None)


def _types(prop: dict[str, Any]) -> set[str]:
    declared = prop.get("type")
    types = {declared} if isinstance(declared, str) else set(declared or [])
    for alt in [*prop.get("anyOf", []), *prop.get("oneOf", [])]:
        if isinstance(alt, dict):
            types |= _types(alt)
    return types


def _placeholder(name: str, prop: dict[str, Any], purpose: str) -> Any:
    """A harmless value for a required argument the script says nothing about."""
    if "default" in prop:
        return prop["default"]
    if prop.get("enum"):
        return prop["enum"][0]
    types = _types(prop)
    if "string" in types:
        return "." if "dir" in name.lower() or name.lower() == "cwd" else purpose
    if "boolean" in types:
        return False
    if types & {"integer", "number"}:
        # A timeout too short would kill the command; 60000 is a minute in ms and merely long in seconds.
        return prop.get("minimum", 60000 if "timeout" in name.lower() else 1)
    if "array" in types:
        return []
    if "object" in types:
        return {}
    return None


def _fill_required(schema: dict[str, Any], args: dict[str, Any], purpose: str) -> dict[str, Any]:
    props = schema.get("properties") or {}
    for name in schema.get("required") or []:
        if name not in args:
            args[name] = _placeholder(name, props.get(name) or {}, purpose)
    return args


def _shell_arguments(schema: dict[str, Any], command: str) -> dict[str, Any]:
    props: dict[str, Any] = schema.get("properties") or {}
    required = list(schema.get("required") or [])
    if "cmd" in props:
        key = "cmd"
    elif "command" in props:
        key = "command"
    else:
        strings = [name for name in [*required, *props] if "string" in _types(props.get(name) or {})]
        key = strings[0] if strings else "command"
    types = _types(props.get(key) or {})
    value: Any = ["bash", "-lc", command] if "array" in types and "string" not in types else command
    return _fill_required(schema, {key: value}, "run command")


def _write_command(path: str, content: str) -> str:
    # printf '%s' with shell quoting copes with any content; a heredoc could collide with its delimiter.
    parent = path.rsplit("/", 1)[0] if "/" in path.strip("/") else ""
    prefix = f"mkdir -p {shlex.quote(parent)} && " if parent else ""
    return f"{prefix}printf '%s' {shlex.quote(content)} > {shlex.quote(path)}"


def _write_arguments(schema: dict[str, Any], path: str, content: str) -> dict[str, Any] | None:
    props = schema.get("properties") or {}
    path_key = next((key for key in _PATH_KEYS if key in props), None)
    content_key = next((key for key in _CONTENT_KEYS if key in props), None)
    if path_key is None or content_key is None:
        return None
    return _fill_required(schema, {path_key: path, content_key: content}, "write file")


# Auxiliary requests (titles, summaries) that must not consume a scripted step


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _system_text(body: dict[str, Any]) -> str:
    parts = [_text_of(body.get("instructions"))]
    items = body.get("messages") or body.get("input") or []
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and item.get("role") in ("system", "developer"):
                parts.append(_text_of(item.get("content")))
    return " ".join(parts).lower()


def _is_aux(body: dict[str, Any]) -> bool:
    model = str(body.get("model") or "").lower()
    if "small" in model or "aux" in model:
        return True
    system = _system_text(body)
    return not body.get("tools") and ("title" in system or "summar" in system)


def _generated(reply: _Reply) -> list[str]:
    """What the fake model generated, in the parts it streams: a call's name, then its arguments."""
    return [reply.call.name, reply.call.arguments] if reply.call else [reply.text]
