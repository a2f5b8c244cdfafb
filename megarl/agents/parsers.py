"""Which SGLang tool-call parser reads a model's tool calls (``rollout.tool_call_parser``): the names
SGLang registers, and the default of a model family. Imports no parser, nor the ``sglang`` package
(checking a config stays cheap)."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

# HF ``model_type`` -> the parser of the format its chat template writes tool calls in
FAMILY_PARSERS = {
    "qwen2": "qwen25", "qwen2_moe": "qwen25", "qwen3": "qwen25", "qwen3_moe": "qwen25",
    "qwen3_next": "qwen25", "deepseek_v3": "deepseekv3", "deepseek_v32": "deepseekv32",
    "glm4_moe": "glm45", "kimi_k2": "kimi_k2", "gpt_oss": "gpt-oss", "llama": "llama3",
    "mistral": "mistral", "mixtral": "mistral", "minimax_m2": "minimax-m2",
}


@functools.cache
def parser_names() -> frozenset[str]:
    """SGLang's registered parser names, read from its dependency-free ``parser_names.py`` (importing
    ``sglang.srt`` would cost seconds)."""
    sglang = importlib.util.find_spec("sglang")
    if sglang is None or sglang.origin is None:
        raise ImportError("sglang is not installed: no tool-call parsers")
    path = Path(sglang.origin).parent / "srt" / "function_call" / "parser_names.py"
    spec = importlib.util.spec_from_file_location("_sglang_parser_names", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return frozenset(module.TOOL_CALL_PARSER_NAMES)


def tool_call_parser(configured: str | None, model_type: str | None) -> str | None:
    """``configured`` when given (ValueError naming ``rollout.tool_call_parser`` if SGLang has no such
    parser), else the family's default; None when neither names one (the gateway then refuses ``tools``)."""
    if configured is None:
        return FAMILY_PARSERS.get(model_type or "")
    if configured not in parser_names():
        raise ValueError(f"rollout.tool_call_parser: SGLang has no tool-call parser {configured!r}; "
                         f"choose one of {sorted(parser_names())}")
    return configured
