"""OpenAI response bodies of one gateway answer: ``chat.completion`` / ``text_completion`` objects and,
for ``stream=True``, the chunks of server-sent events whose concatenation is that answer (the role,
the content, each tool call whole, then the finish reason; usage last when asked for)."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its text (decoded alone) and the log-prob it was sampled with."""

    token: str
    logprob: float


@dataclass(frozen=True)
class Answer:
    """A generated answer: ``content`` (text), ``tool_calls`` (OpenAI dicts, None without), the OpenAI
    ``finish_reason``, ``usage`` (prompt / completion / total tokens) and, when asked for, ``logprobs``."""

    model: str
    content: str
    tool_calls: list[dict] | None
    finish_reason: str
    usage: dict[str, int]
    logprobs: tuple[TokenLogprob, ...] | None = None


def chat_body(answer: Answer) -> dict:
    message = {"role": "assistant", "content": answer.content if answer.content or not answer.tool_calls else None}
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    choice = {"index": 0, "message": message, "finish_reason": answer.finish_reason,
              "logprobs": _chat_logprobs(answer.logprobs)}
    return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
            "model": answer.model, "choices": [choice], "usage": answer.usage}


def completion_body(answer: Answer) -> dict:
    choice = {"index": 0, "text": answer.content, "finish_reason": answer.finish_reason,
              "logprobs": _completion_logprobs(answer.logprobs)}
    return {"id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion", "created": int(time.time()),
            "model": answer.model, "choices": [choice], "usage": answer.usage}


def chat_chunks(answer: Answer, include_usage: bool) -> list[dict]:
    """``chat.completion.chunk`` objects: role, content (with its log-probs), one per tool call, finish."""
    head = {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": answer.model}
    deltas = [({"role": "assistant", "content": ""}, None)]
    if answer.content or answer.logprobs:
        deltas.append(({"content": answer.content}, _chat_logprobs(answer.logprobs)))
    deltas += [({"tool_calls": [{"index": i, **call}]}, None) for i, call in enumerate(answer.tool_calls or ())]
    chunks = [{**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}]}
              for delta, logprobs in deltas]
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": answer.finish_reason}]})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer.usage})
    return chunks


def completion_chunks(answer: Answer, include_usage: bool) -> list[dict]:
    """``text_completion`` chunks: the text (with its log-probs), then the finish reason."""
    head = {"id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion", "created": int(time.time()),
            "model": answer.model}
    chunks = [{**head, "choices": [{"index": 0, "text": answer.content, "finish_reason": None,
                                    "logprobs": _completion_logprobs(answer.logprobs)}]},
              {**head, "choices": [{"index": 0, "text": "", "finish_reason": answer.finish_reason,
                                    "logprobs": None}]}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer.usage})
    return chunks


def _chat_logprobs(logprobs: tuple[TokenLogprob, ...] | None) -> dict | None:
    if logprobs is None:
        return None
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
                         "top_logprobs": []} for t in logprobs]}


def _completion_logprobs(logprobs: tuple[TokenLogprob, ...] | None) -> dict | None:
    if logprobs is None:
        return None
    offsets, at = [], 0
    for t in logprobs:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in logprobs], "token_logprobs": [t.logprob for t in logprobs],
            "top_logprobs": None, "text_offset": offsets}
