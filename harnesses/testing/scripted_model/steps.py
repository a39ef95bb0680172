"""A script's steps, what each makes the scripted model do, and the parse that names a bad step."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class _StepBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextStep(_StepBase):
    type: Literal["text"]
    text: str
    finish_reason: Literal["stop", "length"] = "stop"
    usage: bool = True


class ShellStep(_StepBase):
    type: Literal["shell"]
    command: str


class WriteStep(_StepBase):
    type: Literal["write"]
    path: str
    content: str


class ToolStep(_StepBase):
    type: Literal["tool"]
    name: str
    arguments: dict[str, Any]


class ErrorStep(_StepBase):
    """An HTTP error. ``run_wide``: the endpoint refuses the run itself (its key, model or account), so
    from then on a request outside every session's script (the gateway's probe of the run's config, which
    carries no session) gets this error too; otherwise only the session's request does."""

    type: Literal["error"]
    status: int = Field(ge=100, le=599)
    headers: dict[str, str] = Field(default_factory=dict)
    body: str | None = None
    run_wide: bool = False


class DropStep(_StepBase):
    """Stream the start of a text answer, then break off: a reset (``clean`` false), or a clean end of
    the body without the stream's terminal event (``clean``), as a proxy that times out a stream does."""

    type: Literal["drop"]
    after_chunks: int = Field(default=2, ge=0)
    clean: bool = False


class KeepaliveStep(_StepBase):
    """Answer 200 as an event stream, send ``after_chunks`` text chunks (0: none), then only SSE comment
    lines (``: keep-alive``) every ``interval_s`` until ``max_s``, then cut: a proxy holding a request in
    its queue. No content ever comes after the chunks."""

    type: Literal["keepalive"]
    interval_s: float = Field(default=1.0, gt=0)
    max_s: float = Field(default=600.0, gt=0)
    after_chunks: int = Field(default=0, ge=0)


class BadAnswerStep(_StepBase):
    """A 2xx answer that is no answer: ``html``, a proxy's page; ``json``, a whole JSON answer to a request
    that asked for a stream (or an event stream to one that did not); ``empty``, no body at all."""

    type: Literal["bad_answer"]
    form: Literal["html", "json", "empty"] = "html"
    status: int = Field(default=200, ge=200, le=299)


class HangStep(_StepBase):
    """Say nothing until ``max_s``, then cut the connection. With ``after_chunks`` the answer starts
    first: a stream sends its preamble and that many text chunks (as ``drop`` does), a non-streamed answer
    its headers and that many 16-byte pieces of its JSON (0: the headers alone)."""

    type: Literal["hang"]
    max_s: float = Field(default=600.0, gt=0)
    after_chunks: int | None = Field(default=None, ge=0)


class WaitStep(_StepBase):
    """Hold the request until ``release(gate)`` is called (or ``max_s`` passed), then answer it with the
    script's next step: a session that finishes when a test, or a toy trainer, lets it."""

    type: Literal["wait"]
    gate: str
    max_s: float = Field(default=120.0, gt=0)


class StreamErrorStep(_StepBase):
    """A 200 answer that fails inside: a stream sends its preamble and ``after_chunks`` text chunks, then
    the error in the API's own form, then ends cleanly. ``form``: ``native`` is a Chat chunk carrying
    ``error`` / a Responses ``response.failed``; ``event`` is an SSE ``event: error``; ``incomplete`` is a
    Responses ``response.incomplete`` carrying the error (Chat: as ``native``). A non-streamed request
    gets a 200 JSON body with a top-level ``error``."""

    type: Literal["stream_error"]
    message: str = "The server had an error while processing your request."
    code: str | int | None = "server_error"
    after_chunks: int = Field(default=2, ge=0)
    form: Literal["native", "event", "incomplete"] = "native"


Step = Annotated[
    TextStep
    | ShellStep
    | WriteStep
    | ToolStep
    | ErrorStep
    | DropStep
    | HangStep
    | StreamErrorStep
    | KeepaliveStep
    | BadAnswerStep
    | WaitStep,
    Field(discriminator="type"),
]
_STEP_ADAPTER: TypeAdapter[Step] = TypeAdapter(Step)


def parse_steps(data: list[dict[str, Any]]) -> list[Step]:
    """Validate a JSON script; the error names the first bad step so a script author can find it."""
    if not isinstance(data, list):
        raise ValueError(f"a script must be a list of steps, got {type(data).__name__}")
    if not data:
        raise ValueError("a script must have at least one step")
    steps: list[Step] = []
    for index, item in enumerate(data):
        try:
            steps.append(_STEP_ADAPTER.validate_python(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"][1:])
            raise ValueError(f"step {index}: {where + ': ' if where else ''}{first['msg']}") from None
    return steps
