"""The engine's side of :mod:`megarl.wire.metadata` (installed on every platform): a ``/generate`` request
that carries :data:`~megarl.wire.metadata.HEADER` and does not stream gets its answer packed as binary arrays
(:func:`~megarl.wire.metadata.pack_answer`), in the HTTP process where SGLang makes the answer.
"""
from __future__ import annotations

import numpy as np

from megarl.wire.metadata import EXPERT_DTYPES, HEADER, pack_answer

_original_generate = None  # SGLang's TokenizerManager.generate_request and orjson_response, kept by install()
_original_response = None


class BinaryAnswer(bytes):
    """A packed answer on its way to :func:`answer_response`."""


async def generate_request(manager, obj, request=None):
    """SGLang's ``generate_request``, its answers packed (:func:`pack_answer`) when ``request`` is a
    ``/generate`` that carries :data:`HEADER` and does not stream."""
    name = request.headers.get(HEADER) if request is not None and request.url.path == "/generate" else None
    if name is not None and name not in EXPERT_DTYPES:
        raise ValueError(f"{HEADER} must name one of {', '.join(EXPERT_DTYPES)}, got {name!r}")
    async for out in _original_generate(manager, obj, request):
        packed = name is not None and not getattr(obj, "stream", False)
        yield BinaryAnswer(pack_answer(out, np.dtype(name))) if packed else out


def answer_response(content, status_code: int = 200):
    """SGLang's ``orjson_response``, or a packed answer's bytes as they are."""
    from fastapi import Response

    if isinstance(content, BinaryAnswer):
        return Response(content=bytes(content), status_code=status_code, media_type="application/octet-stream")
    return _original_response(content, status_code)


def install() -> None:
    """Route ``TokenizerManager.generate_request`` through :func:`generate_request` and the HTTP server's
    ``orjson_response`` through :func:`answer_response` (idempotent)."""
    global _original_generate, _original_response
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    if TokenizerManager.generate_request is generate_request:
        return
    _original_generate, _original_response = TokenizerManager.generate_request, http_server.orjson_response
    TokenizerManager.generate_request = generate_request
    http_server.orjson_response = answer_response
