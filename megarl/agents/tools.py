"""OpenAI function calling for the gateway, with SGLang's own tool-call machinery
(``sglang.srt.function_call``, as its OpenAI server ``serving_chat.py`` applies it).

- :func:`tool_use` reads a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``;
- :func:`grammar` is the generation constraint of ``tool_choice`` ``required`` or a named function
  (the parser's structural tag, or SGLang's JSON-schema of a call list where the parser has none),
  as SGLang sampling-param entries; ``none`` and ``auto`` constrain nothing;
- :func:`parse_calls` turns the generated text into OpenAI ``tool_calls`` (ids ``call_<hex>``,
  arguments a JSON string) with the served model's parser; text that starts a call the parser cannot
  read (a malformed or truncated call) comes back as content, flagged ``unparsable``.

The parser only reads the text: the tokens the model generated are recorded as they are.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.entrypoints.openai.protocol import Tool, ToolChoice

TOOL_CHOICES = ("none", "auto", "required")


class ToolRequestError(ValueError):
    """A malformed tool request: ``param`` names the request field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools (SGLang ``Tool`` models), its ``choice`` ("none", "auto", "required", or
    a ``ToolChoice`` naming one function) and whether several calls may come in one answer."""

    tools: tuple[Tool, ...]
    choice: str | ToolChoice
    parallel: bool

    @property
    def required(self) -> bool:
        return self.choice == "required" or not isinstance(self.choice, str)

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the chat template shows and the parser reads: none for "none", the named one alone."""
        if self.choice == "none":
            return ()
        if isinstance(self.choice, str):
            return self.tools
        return tuple(t for t in self.tools if t.function.name == self.choice.function.name)


def tool_use(body: dict) -> ToolUse | None:
    """The request's tool use, None without ``tools``; :class:`ToolRequestError` for bad input."""
    from pydantic import ValidationError
    from sglang.srt.entrypoints.openai.protocol import Tool, ToolChoice

    raw_tools, raw_choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError("parallel_tool_calls", f"'parallel_tool_calls' must be a boolean, got {parallel!r}")
    if raw_tools is None:
        if raw_choice not in (None, "none", "auto"):
            raise ToolRequestError("tool_choice", f"'tool_choice' {raw_choice!r} needs 'tools'")
        return None
    if not isinstance(raw_tools, list) or not raw_tools:
        raise ToolRequestError("tools", "'tools' must be a non-empty list of {type: function, function} objects")
    try:
        tools = tuple(Tool.model_validate(t) for t in raw_tools)
    except ValidationError as e:
        raise ToolRequestError("tools", f"'tools' is malformed: {e.errors()[0]['msg']} "
                                        f"at {e.errors()[0]['loc']}") from e
    if any(t.type != "function" for t in tools):
        raise ToolRequestError("tools", "only tools of type 'function' are supported")
    choice = "auto" if raw_choice is None else raw_choice
    if isinstance(choice, dict):
        try:
            choice = ToolChoice.model_validate(choice)
        except ValidationError as e:
            raise ToolRequestError("tool_choice", f"'tool_choice' is malformed: {e.errors()[0]['msg']}") from e
        if choice.function.name not in {t.function.name for t in tools}:
            raise ToolRequestError("tool_choice", f"'tool_choice' names {choice.function.name!r}, not one of the "
                                                  f"tools {[t.function.name for t in tools]}")
    elif choice not in TOOL_CHOICES:
        raise ToolRequestError("tool_choice", f"'tool_choice' must be one of {TOOL_CHOICES} or "
                                              f"{{type: function, function: {{name}}}}, got {choice!r}")
    return ToolUse(tools=tools, choice=choice, parallel=parallel is not False)


def grammar(parser_name: str, use: ToolUse) -> tuple[tuple[str, object], ...]:
    """SGLang sampling-param entries that make the model call a tool (``required``, a named function),
    chosen as SGLang's server chooses them; () for ``none`` and ``auto``."""
    if not use.required:
        return ()
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.function_call.utils import get_json_schema_constraint

    tools = list(use.offered)
    constraint = FunctionCallParser(tools, parser_name).get_structure_constraint(use.choice,
                                                                                 parallel_tool_calls=use.parallel)
    if constraint is None:
        constraint = ("json_schema", get_json_schema_constraint(tools, use.choice, parallel_tool_calls=use.parallel))
    kind, value = constraint
    if kind == "structural_tag":
        return (("structural_tag", json.dumps(value.model_dump(by_alias=True))),)
    if kind == "json_schema":
        return (("json_schema", json.dumps(value)),)
    if kind == "full_assistant_ebnf":
        return (("ebnf", value), ("ebnf_full_assistant", True))
    return ((kind, value),)


@dataclass(frozen=True)
class ParsedAnswer:
    """What the parser made of a generated text: the ``content`` left, OpenAI ``tool_calls`` (None when
    there are none), and ``unparsable``: the text holds a call the parser could not read."""

    content: str
    tool_calls: list[dict] | None
    unparsable: bool = False


def parse_calls(parser_name: str, use: ToolUse, text: str, tokenizer=None) -> ParsedAnswer:
    """The tool calls in ``text`` (SGLang's ``_process_tool_calls``: the model's own format, or for a
    required call constrained by JSON schema, the JSON list of ``{name, parameters}``)."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    tools = list(use.offered)
    if not tools:
        return ParsedAnswer(text, None)
    parser = FunctionCallParser(tools, parser_name, tokenizer=tokenizer, tool_choice=use.choice)
    owns_format = parser.owns_tool_format()
    if (not use.required or owns_format) and parser.has_tool_call(text):
        try:
            content, calls = parser.parse_non_stream(text)
        except Exception:  # noqa: BLE001 -- a parser's error on model text is an unparsable call, counted
            return ParsedAnswer(text, None, unparsable=True)
        if not calls:
            return ParsedAnswer(text, None, unparsable=True)
        return ParsedAnswer(content, [_call(c.name, c.parameters) for c in calls])
    if not use.required:
        return ParsedAnswer(text, None)
    if owns_format:  # constrained to call, yet no call: cut by the token budget
        return ParsedAnswer(text, None, unparsable=True)
    return _json_calls(text)


def _json_calls(text: str) -> ParsedAnswer:
    try:
        data = json.loads(text)
    except ValueError:
        return ParsedAnswer(text, None, unparsable=True)
    data = [data] if isinstance(data, dict) else data
    if not (isinstance(data, list) and data and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                    for c in data)):
        return ParsedAnswer(text, None, unparsable=True)
    return ParsedAnswer("", [_call(c["name"], json.dumps(c.get("parameters", c.get("arguments", {})),
                                                         ensure_ascii=False)) for c in data])


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def calls_key(tool_calls) -> tuple | None:
    """What identifies the tool calls of an assistant message the gateway returned: (id, name,
    arguments) per call; None when ``tool_calls`` is not a list of such calls."""
    if not isinstance(tool_calls, list) or not tool_calls:
        return None
    try:
        return tuple((c["id"], c["function"]["name"], c["function"]["arguments"]) for c in tool_calls)
    except (KeyError, TypeError):
        return None
