"""How an answer's text is cut for a stream, and its token ids and logprobs when a request asks for them
with vLLM's parameters (a fake tokenizer: deterministic, so tests can predict them)."""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any, Literal

_DELTA_CHARS = 16


def _chunks(text: str) -> list[str]:
    return [text[i : i + _DELTA_CHARS] for i in range(0, len(text), _DELTA_CHARS)]


@dataclass(frozen=True)
class _Tokens:
    """What a request asked for: chat ``logprobs`` / ``top_logprobs`` / ``return_token_ids`` /
    ``return_tokens_as_token_ids``; Responses ``include: [message.output_text.logprobs]`` /
    ``enable_response_messages``. vLLM reads ``return_tokens_as_token_ids`` for /responses from a server
    flag; here the request's word stands in for it."""

    logprobs: bool
    ids: bool  # prompt and completion ids on the answer
    as_ids: bool  # a logprob's token reads "token_id:<id>"
    top: int
    prompt: tuple[int, ...]


def _pieces(text: str) -> list[str]:
    # The fake tokenizer: each word with the whitespace before it, so the pieces join back to the text.
    return re.findall(r"\s*\S+|\s+", text)


def _token_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) % 100_000 + 1


def _token_ids(text: str) -> list[int]:
    return [_token_id(piece) for piece in _pieces(text)]


def _logprob(token_id: int) -> float:
    return -((token_id % 97) + 1) / 100


def _tokens_asked(body: dict[str, Any], api: Literal["responses", "chat"], raw: bytes) -> _Tokens | None:
    if api == "chat":
        logprobs, ids = bool(body.get("logprobs")), bool(body.get("return_token_ids"))
    else:
        include = body.get("include") if isinstance(body.get("include"), list) else []
        logprobs = "message.output_text.logprobs" in include
        ids = bool(body.get("enable_response_messages"))
    if not (logprobs or ids):
        return None
    top = body.get("top_logprobs")
    return _Tokens(
        logprobs=logprobs,
        ids=ids,
        as_ids=bool(body.get("return_tokens_as_token_ids")),
        top=top if isinstance(top, int) and not isinstance(top, bool) and 0 < top <= 20 else 0,
        prompt=tuple(_token_ids(raw.decode("utf-8", "replace"))),
    )


def _logprob_entries(text: str, tokens: _Tokens) -> list[dict[str, Any]]:
    def entry(piece: str, token_id: int, logprob: float) -> dict[str, Any]:
        shown = f"token_id:{token_id}" if tokens.as_ids else piece
        return {"token": shown, "logprob": logprob, "bytes": list(shown.encode())}

    out = []
    for piece in _pieces(text):
        token_id = _token_id(piece)
        alternatives = [entry(piece, token_id, _logprob(token_id))]
        alternatives += [
            entry(f"<alt{k}>", token_id + k, _logprob(token_id) - k) for k in range(1, tokens.top)
        ]
        out.append({**alternatives[0], "top_logprobs": alternatives[: tokens.top]})
    return out
