"""megarl's OpenAI-compatible agent gateway: ``/v1/chat/completions`` and ``/v1/completions`` in
front of the engines, recording every call of an episode into its :class:`~megarl.agents.trajectory.Trajectory`.

An aiohttp server inside the driver's asyncio loop, on a free port of ``host`` (loopback when the
agents run in the driver; this node's routable address when they run in agent workers on any node,
``megarl/agents/workers.py``). Each episode is a session with an unguessable id and a credential of
its own (``Session.key``); its base URL ``http://host:port/sessions/<id>/v1`` and its key are what an
``openai.AsyncOpenAI(base_url=..., api_key=...)`` client takes unchanged. A call without the session's
key as its bearer token is refused (401, code ``invalid_api_key``), before anything is parsed. A call
is generated on the engines with megarl's own client (log-probs, routed experts, sampling mask,
versions) and recorded; the answer is an OpenAI response body.

Tokens, never re-tokenized (slime's router middleware and AReaL's ``areal/experimental/openai``
client keep the engine's tokens for the same reason: text -> tokens does not invert tokens -> text).
A chat call's prompt is rendered by the tokenizer's own chat template
(``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True)``); a completion
call's prompt is its text. The call extends a segment of its role when the rendered text starts
with that segment's key: the previous call's prompt text + the completion text the gateway
returned + the text of the special token that ended the generation (EOS, which a chat template
writes after the assistant's content; other special tokens are invisible in the text, wherever
they are). Then the segment's token ids are reused as they are and only the rest of the text is
tokenized (``add_special_tokens=False``). A call that extends
no segment -- the agent rewrote or truncated its history, or changed the returned content, or
started another conversation -- opens a new segment, tokenized from its text: every segment is a
sample of its own (``megarl/agents/trajectory.py``), so a rewritten history is kept as a second
sample, never spliced into the first. A segment with a call in flight is not extended by a
concurrent call of the same role (that call opens a segment too).

Completion text: the generated tokens decoded without special tokens; a stop string is kept in the
text (SGLang's tokens hold it, and the next call's prompt must contain it to extend the segment).
To continue after an end-of-sequence token, a completions-API agent must write its text too.

Sampling, bounded by the rollout config's :class:`SamplingParams` ``params``:
``max_tokens`` (or ``max_completion_tokens``) = min(request, ``params.max_new_tokens``, the
response budget left in the segment, the context left); ``top_p`` = min(request, ``params.top_p``);
``temperature`` and ``top_k`` are always the config's (the trainer scores tokens under the config's
temperature; a request's temperature is ignored, logged once), but a frozen role's calls sample at the
request's temperature (nothing trains on them; e.g. a greedy verifier); ``stop`` (a string or a list) is the
request's. ``n`` other than 1, ``top_logprobs`` and any field not listed in ``CHAT_FIELDS`` /
``COMPLETION_FIELDS`` are refused (400 naming the field); ``logprobs`` gives each generated token's
sampling log-prob; ``stream`` sends the generated answer as server-sent events (``megarl/agents/responses.py``).

Tool calls (``tools``, ``tool_choice``, ``parallel_tool_calls``; ``megarl/agents/tools.py``): a required or
named call constrains generation with SGLang's grammar for the model's format; the text is parsed into
OpenAI ``tool_calls`` by the ``tool_call_parser``; the tokens are recorded as generated. An assistant message
that carries calls this session returned is rendered as the text generated with them, so that the
conversation extends its segment (docs/agents.md).

Roles (multi-agent): with ``roles`` None every call is the one policy's (role ""), whatever its
``model``; with ``roles`` (role name -> :class:`~megarl.engines.protocol.Engines`) the request's
``model`` names the role and its engines (several roles may share one target; targets must share
the tokenizer); another name is a 404 ``model_not_found``. Roles in ``frozen_roles`` are served by
frozen models: their calls are generated without routed experts or sampling masks (nothing trains on them).

Budgets: a role's call beyond ``max_turns`` is refused (400, code ``max_turns_exceeded``) and a call
whose segment has no response budget left (``max_response_tokens``, or the context) is refused
(400, code ``max_tokens_exceeded``); the session remembers the first such refusal as
``budget_end`` ("max_turns" / "max_tokens"). Errors: an unknown or closed session is 404
(``session_not_found``), a malformed request 400 naming the field, an engine that rejects the prompt
400, an unreachable engine 503 (kept in ``Session.engine_failure`` for the caller to raise). All
error bodies are OpenAI's ``{"error": {"message", "type", "param", "code"}}``.

With ``partial_rollout="abort_resubmit"`` a call that comes back aborted (a weight update paused
the engines with abort) is continued at once from its prompt + partial tokens for the rest of its
budget (as ``RolloutManager`` does); the pieces are recorded as calls of one turn.
"""
from __future__ import annotations

import collections
import dataclasses
import hmac
import json
import logging
import numbers
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from megarl.agents import tools as tool_calls
from megarl.agents.responses import Answer, TokenLogprob, chat_body, chat_chunks, completion_body, completion_chunks
from megarl.agents.trajectory import Call, Segment, Trajectory
from megarl.engines.protocol import Engines
from megarl.engines.types import EngineError, EngineUnreachable, GenerationOptions, SamplingParams
from megarl.sample import FinishReason, RolloutSample

log = logging.getLogger(__name__)

PARTIAL_ROLLOUT_MODES = ("continue", "abort_resubmit")
_OPENAI_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORTED: "length"}
_SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "stop", "n", "stream", "stream_options", "logprobs"}
CHAT_FIELDS = frozenset(_SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                                            "tool_choice", "parallel_tool_calls"})
COMPLETION_FIELDS = frozenset(_SAMPLING_FIELDS | {"prompt"})


class GatewayError(Exception):
    """A refused call: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> web.Response:
        kind = {400: "invalid_request_error", 401: "authentication_error",
                404: "invalid_request_error"}.get(self.status, "server_error")
        return web.json_response({"error": {"message": self.message, "type": kind, "param": self.param,
                                            "code": self.code}}, status=self.status)


@dataclass
class Session:
    """One episode's state in the gateway. ``key``: the credential its calls carry (``Authorization:
    Bearer <key>``, the OpenAI client's ``api_key``); ``turns``: calls per role; ``budget_end``: "max_turns" or
    "max_tokens" once a call was refused for a budget; ``engine_failure``: an engine was unreachable;
    ``tool_call_counts``: this episode's share of the gateway's (answers with ``parsed`` or ``unparsable`` calls)."""

    id: str
    group_id: str
    episode_id: str
    key: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    trajectory: Trajectory = field(default_factory=Trajectory)
    turns: collections.Counter[str] = field(default_factory=collections.Counter)
    budget_end: str | None = None
    engine_failure: EngineUnreachable | None = None
    closed: bool = False
    # the tool calls of answers returned (tools.calls_key) -> the text generated with them
    returned_calls: dict[tuple, str] = field(default_factory=dict)
    tool_call_counts: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class _Request:
    """A parsed call: the prompt text, the role, and the sampling the request asks for."""

    text: str
    model: str
    max_tokens: int | None
    top_p: float
    stop: tuple[str, ...]
    temperature: float | None  # as asked; None: not given
    tools: tool_calls.ToolUse | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage


@dataclass(frozen=True)
class GatewaySettings:
    """How the gateway serves an episode's calls: at most ``max_turns`` calls per role; ``max_response_tokens``
    bounds a segment's response (None: the context only); ``partial_rollout`` (:data:`PARTIAL_ROLLOUT_MODES`):
    what a call cut by a weight update does; ``frozen_roles``: the roles served by frozen models (their
    calls are not trained on); ``tool_call_parser``: SGLang's parser of the served model's tool calls
    (``megarl/agents/parsers.py``; None: chat calls with ``tools`` are refused); it listens on ``host``
    (``port`` 0: a free one)."""

    max_turns: int
    max_response_tokens: int | None = None
    partial_rollout: str = "continue"
    frozen_roles: Collection[str] = ()
    tool_call_parser: str | None = None
    host: str = "127.0.0.1"
    port: int = 0


class AgentGateway:
    """The gateway (module docstring). ``async with`` (or :meth:`start` / :meth:`aclose`); then per
    episode :meth:`open_session` (its ``key`` is the client's ``api_key``), :meth:`base_url`, and
    :meth:`close_session` (later calls: 404).

    ``generation``: the sampling (each call's own within it) and what comes back with each token;
    ``settings``: :class:`GatewaySettings`; ``roles``: role name -> its engines (None = ``policy``);
    None = one role, "". ``tool_call_counts``: answers whose text held tool calls, ``parsed`` or
    ``unparsable`` (returned as text), over the gateway's life."""

    def __init__(self, policy: Engines, tokenizer, generation: GenerationOptions, settings: GatewaySettings,
                 roles: Mapping[str, Engines | None] | None = None):
        max_turns, max_response_tokens = settings.max_turns, settings.max_response_tokens
        partial_rollout, frozen_roles = settings.partial_rollout, settings.frozen_roles
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_response_tokens is not None and max_response_tokens < 1:
            raise ValueError(f"max_response_tokens must be >= 1 or None, got {max_response_tokens}")
        if partial_rollout not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(f"partial_rollout must be one of {PARTIAL_ROLLOUT_MODES}, got {partial_rollout!r}")
        if roles is not None and (not roles or "" in roles):
            raise ValueError(f"roles must name at least one role, none of them empty; got {list(roles)}")
        if frozen_roles and not set(frozen_roles) <= set(roles or ()):
            raise ValueError(f"frozen_roles {sorted(frozen_roles)} must be roles of {sorted(roles or ())}")
        if getattr(tokenizer, "chat_template", None) is None:
            log.warning("the tokenizer has no chat template: /v1/chat/completions will answer 400")
        self.policy, self.tokenizer, self.params = policy, tokenizer, generation.params
        self.roles = {role: t if t is not None else policy for role, t in roles.items()} if roles is not None else None
        self.max_turns, self.max_response_tokens = max_turns, max_response_tokens
        self.routing, self.sampling_mask = generation.routing, generation.sampling_mask
        self.partial_rollout = partial_rollout
        self.frozen_roles = frozenset(frozen_roles)
        self.tool_call_parser = settings.tool_call_parser
        self.tool_call_counts: collections.Counter[str] = collections.Counter()
        self.host, self.port = settings.host, settings.port
        self.sessions: dict[str, Session] = {}
        self._special_ids = set(tokenizer.all_special_ids)
        self._runner: web.AppRunner | None = None
        self._warned_temperature = False

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen on ``host`` (``port`` 0: a free one, then ``self.port`` is it)."""
        app = web.Application()
        app.router.add_post("/sessions/{session}/v1/chat/completions", self._chat)
        app.router.add_post("/sessions/{session}/v1/completions", self._completion)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        log.info("agent gateway listening on http://%s:%d", self.host, self.port)

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> AgentGateway:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    @property
    def started(self) -> bool:
        return self._runner is not None

    def open_session(self, group_id: str = "", episode_id: str = "") -> Session:
        session = Session(id=secrets.token_urlsafe(12), group_id=group_id, episode_id=episode_id)
        self.sessions[session.id] = session
        return session

    def base_url(self, session_id: str) -> str:
        """The OpenAI base URL of a session (ends in ``/v1``)."""
        if not self.started:
            raise RuntimeError("the gateway is not started")
        return f"http://{self.host}:{self.port}/sessions/{session_id}/v1"

    def close_session(self, session_id: str) -> Session:
        """End a session: calls still in flight are not recorded, later calls get 404."""
        session = self.sessions.pop(session_id)
        session.closed = True
        return session

    # --- HTTP -------------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.Response:
        return await self._serve(request, chat=True)

    async def _completion(self, request: web.Request) -> web.Response:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            session = self._session(request.match_info["session"])
            _authenticate(request, session)
            body = await _json_body(request)
            call = self._parse(body, chat, session)
            role, target = self._role(call.model)
            answer = await self._generate(session, role, target, call)
        except GatewayError as e:
            return e.response()
        if not call.stream:
            return web.json_response(chat_body(answer) if chat else completion_body(answer))
        chunks = (chat_chunks if chat else completion_chunks)(answer, call.include_usage)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise GatewayError(404, f"unknown session {session_id!r} (never opened, or its episode has ended)",
                               "session_not_found")
        return session

    def _role(self, model: str) -> tuple[str, Engines]:
        if self.roles is None:
            return "", self.policy
        if model not in self.roles:
            raise GatewayError(404, f"model {model!r} is not a role of this gateway; roles: {sorted(self.roles)}",
                               "model_not_found", "model")
        return model, self.roles[model]

    def _parse(self, body: dict, chat: bool, session: Session) -> _Request:
        unknown = sorted(k for k, v in body.items() if v is not None and k not in (CHAT_FIELDS if chat
                                                                                  else COMPLETION_FIELDS))
        if unknown:
            raise _bad(unknown[0], f"the megarl gateway does not implement {', '.join(map(repr, unknown))} "
                                   f"(it implements {sorted(CHAT_FIELDS if chat else COMPLETION_FIELDS)})")
        model = body.get("model")
        if not isinstance(model, str):
            raise _bad("model", f"'model' must be a string, got {type(model).__name__}")
        if body.get("n", 1) != 1:
            raise _bad("n", f"'n' must be 1, got {body.get('n')!r}: each call continues one conversation of the "
                            "trajectory; make n calls instead (each becomes a sample of its own)")
        stream, include_usage = _stream_options(body)
        tools = self._tool_use(body) if chat else None
        text = self._render(body, tools, session) if chat else _completion_prompt(body)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise _bad("max_tokens", f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
        temperature = body.get("temperature")
        if temperature is not None and (not _is_number(temperature) or temperature < 0):
            raise _bad("temperature", f"'temperature' must be a number >= 0, got {temperature!r}")
        top_p = body.get("top_p")
        if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
            raise _bad("top_p", f"'top_p' must be a number in (0, 1], got {top_p!r}")
        stop = body.get("stop")
        stop = (stop,) if isinstance(stop, str) else stop if stop is not None else ()
        if not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop", f"'stop' must be a non-empty string or a list of them, got {body.get('stop')!r}")
        return _Request(text=text, model=model, max_tokens=max_tokens,
                        top_p=min(self.params.top_p, top_p if top_p is not None else 1.0), stop=tuple(stop),
                        temperature=temperature, tools=tools, logprobs=_logprobs(body, chat), stream=stream,
                        include_usage=include_usage)

    def _tool_use(self, body: dict) -> tool_calls.ToolUse | None:
        try:
            use = tool_calls.tool_use(body)
        except tool_calls.ToolRequestError as e:
            raise _bad(e.param, str(e)) from e
        if use is not None and use.offered and self.tool_call_parser is None:
            raise _bad("tools", "this model has no tool-call parser: set rollout.tool_call_parser to the SGLang "
                                "parser of its tool-call format")
        return use

    def _temperature(self, role: str, asked: float | None) -> float:
        """The call's sampling temperature: the rollout's, or what a frozen role's call asked for."""
        if asked is None or asked == self.params.temperature:
            return self.params.temperature
        if role in self.frozen_roles:
            return float(asked)
        if not self._warned_temperature:
            self._warned_temperature = True
            log.warning("agent asked for temperature %s; the gateway samples at the rollout's %s (logged once)",
                        asked, self.params.temperature)
        return self.params.temperature

    def _render(self, body: dict, tools: tool_calls.ToolUse | None, session: Session) -> str:
        """The prompt text; an assistant message holding tool calls this session returned is rendered as
        the text generated with them (so that the call extends the segment of that answer's tokens)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "'messages' must be a non-empty list of {role, content} objects")
        rendered = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad("messages", f"messages[{i}] must be an object with a string 'role'")
            generated = session.returned_calls.get(tool_calls.calls_key(m.get("tool_calls"))) \
                if m["role"] == "assistant" else None
            if generated is not None:
                rendered.append({"role": "assistant", "content": generated})
            else:
                rendered.append({**m, "content": _content(m.get("content"), i)})
        offered = [t.model_dump(exclude_none=True) for t in tools.offered] if tools is not None else []
        try:
            return self.tokenizer.apply_chat_template(rendered, tools=offered or None, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 -- the template's error (jinja, missing template) goes back as a 400
            raise _bad("messages", f"the chat template cannot render these messages: {type(e).__name__}: {e}") \
                from e

    # --- generation and recording -----------------------------------------------------------------
    async def _generate(self, session: Session, role: str, target: Engines, call: _Request) -> Answer:
        """Generate one call, record it; returns its answer (:meth:`_answer`)."""
        if session.turns[role] >= self.max_turns:
            session.budget_end = session.budget_end or "max_turns"
            raise GatewayError(400, f"role {role or 'policy'!r} has made its {self.max_turns} calls (max_turns)",
                               "max_turns_exceeded")
        segment = session.trajectory.extendable(role, call.text)
        if segment is not None:
            prompt_ids = segment.token_ids + self._encode(call.text[len(segment.key):])
            done = segment.response_length + len(prompt_ids) - len(segment.token_ids)
        else:
            prompt_ids, done = self._encode(call.text), 0
        budget = min(call.max_tokens or self.params.max_new_tokens, self.params.max_new_tokens,
                     target.model.context_length - len(prompt_ids))
        if self.max_response_tokens is not None:
            budget = min(budget, self.max_response_tokens - done)
        if budget < 1:
            session.budget_end = session.budget_end or "max_tokens"
            raise GatewayError(400, f"no tokens left for this call: {done} response tokens of at most "
                                    f"{self.max_response_tokens}, {len(prompt_ids)} prompt tokens in a context of "
                                    f"{target.model.context_length}", "max_tokens_exceeded")
        if segment is None:
            segment = Segment(role=role)
            session.trajectory.segments.append(segment)
        segment.pending = True
        session.turns[role] += 1
        params = dataclasses.replace(self.params, max_new_tokens=budget, top_p=call.top_p,
                                     temperature=self._temperature(role, call.temperature),
                                     stop=tuple(self.params.stop) + call.stop, grammar=self._grammar(call))
        try:
            pieces = await self._engine_call(session, target, prompt_ids, params, role,
                                             trained=role not in self.frozen_roles)
        finally:
            segment.pending = False
        if session.closed:
            raise GatewayError(404, f"session {session.id!r} ended while its call ran", "session_not_found")
        generated = [t for piece in pieces for t in piece.response_ids]
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        stopped_by_special = pieces[-1].finish_reason is FinishReason.STOP and generated[-1:] \
            and generated[-1] in self._special_ids
        segment.calls += [Call(piece, turn_end=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        segment.key = call.text + text + (self.tokenizer.decode(generated[-1:]) if stopped_by_special else "")
        return self._answer(session, call, pieces, text, len(prompt_ids))

    def _grammar(self, call: _Request) -> tuple[tuple[str, object], ...]:
        if call.tools is None or not call.tools.offered:
            return ()
        try:
            return tool_calls.grammar(self.tool_call_parser, call.tools)
        except ValueError as e:  # e.g. tools whose schemas conflict
            raise _bad("tools", f"SGLang cannot constrain generation to these tools: {e}") from e

    def _answer(self, session: Session, call: _Request, pieces: list[RolloutSample], text: str,
                prompt_tokens: int) -> Answer:
        """The OpenAI answer of a generated call: its tool calls parsed from the text (the tokens stay as
        generated), ``finish_reason`` "tool_calls" when it ended by itself with calls, and the sampled
        tokens' log-probs when asked for."""
        generated = [t for piece in pieces for t in piece.response_ids]
        finish = _OPENAI_FINISH[pieces[-1].finish_reason]
        content, calls = text, None
        if call.tools is not None and call.tools.offered:
            raw = self.tokenizer.decode(generated[:-1] if finish == "stop" and generated[-1:]
                                        and generated[-1] in self._special_ids else generated)
            parsed = tool_calls.parse_calls(self.tool_call_parser, call.tools, raw, self.tokenizer)
            if parsed.tool_calls is not None or parsed.unparsable:
                kind = "unparsable" if parsed.unparsable else "parsed"
                self.tool_call_counts[kind] += 1
                session.tool_call_counts[kind] += 1
            if parsed.tool_calls is not None:
                content, calls = parsed.content, parsed.tool_calls
                session.returned_calls[tool_calls.calls_key(calls)] = text
                finish = "tool_calls" if finish == "stop" else finish
        logprobs = None
        if call.logprobs:
            values = [float(v) for piece in pieces for v in piece.rollout_logprobs]
            logprobs = tuple(TokenLogprob(self.tokenizer.decode([t]), v) for t, v in zip(generated, values))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(generated),
                 "total_tokens": prompt_tokens + len(generated)}
        return Answer(call.model, content, calls, finish, usage, logprobs)

    async def _engine_call(self, session: Session, target: Engines, prompt_ids: list[int],
                           params: SamplingParams, role: str, trained: bool) -> list[RolloutSample]:
        """The engine's sample(s) of one call: one, or with abort_resubmit the aborted parts and their
        continuation, each fed the previous one's prompt + tokens. Routing and masks only when ``trained``;
        the calls of one role of one prompt group share an engine (their prefixes; affinity key)."""
        pieces: list[RolloutSample] = []
        fed, left = prompt_ids, params.max_new_tokens
        while True:
            try:
                [sample] = await target.generate_batch(
                    [fed], dataclasses.replace(params, max_new_tokens=left), group_ids=[session.group_id],
                    return_routed_experts=self.routing and trained, return_sampling_mask=self.sampling_mask and trained,
                    affinity=[f"{session.group_id}/{role}"])
            except EngineUnreachable as e:
                session.engine_failure = e
                raise GatewayError(503, f"engine unreachable: {e}", "engine_unreachable") from e
            except (EngineError, ValueError) as e:
                raise GatewayError(400, f"the engine rejected the prompt: {e}", "engine_rejected") from e
            pieces.append(sample)
            left -= len(sample.response_ids)
            if (self.partial_rollout != "abort_resubmit" or sample.finish_reason is not FinishReason.ABORTED
                    or left < 1):
                return pieces
            fed = fed + sample.response_ids
            log.info("session %s: continuing an aborted call (%d tokens left)", session.id, left)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []


def _authenticate(request: web.Request, session: Session) -> None:
    """401 unless the request's bearer token is ``session``'s key."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise GatewayError(401, f"the call carries no credential for session {session.id!r}: pass the episode's "
                                "session key as the OpenAI client's api_key", "invalid_api_key")
    if not hmac.compare_digest(token.encode(), session.key.encode()):
        raise GatewayError(401, f"the call's api_key is not the credential of session {session.id!r} (each "
                                "episode's client gets its own key)", "invalid_api_key")


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError as e:
        raise GatewayError(400, f"the request body is not JSON: {e}", "invalid_json") from e
    if not isinstance(body, dict):
        raise GatewayError(400, f"the request body must be a JSON object, got {type(body).__name__}", "invalid_json")
    return body


def _bad(param: str, message: str) -> GatewayError:
    return GatewayError(400, message, "invalid_request", param)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _content(content, i: int) -> str:
    """A message's content as text: a string, a list of text parts, or None (an assistant's tool call)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _bad("messages", f"messages[{i}].content must be a string or a list of text parts")


def _stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) of a request."""
    stream, options = body.get("stream") or False, body.get("stream_options")
    if not isinstance(stream, bool):
        raise _bad("stream", f"'stream' must be a boolean, got {stream!r}")
    if options is None:
        return stream, False
    if not stream or not isinstance(options, dict) or set(options) - {"include_usage"} \
            or not isinstance(options.get("include_usage", False), bool):
        raise _bad("stream_options", f"'stream_options' must be {{include_usage: bool}} with stream=true, "
                                     f"got {options!r}")
    return stream, options.get("include_usage", False)


def _logprobs(body: dict, chat: bool) -> bool:
    """Whether the sampled tokens' log-probs are asked for; alternatives (top log-probs) are refused."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise _bad("logprobs", f"'logprobs' must be a boolean, got {logprobs!r}")
        if top not in (None, 0):
            raise _bad("top_logprobs", "'top_logprobs' must be 0 or absent: the engines return the log-prob of "
                                       "the sampled token only (the one the trainer scores), not alternatives")
        return bool(logprobs)
    if logprobs not in (None, 0):
        raise _bad("logprobs", "'logprobs' must be 0 or absent: the engines return the log-prob of the sampled "
                               "token only (the one the trainer scores), not alternatives")
    return logprobs == 0


def _completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "'prompt' must be a non-empty string (or a list holding one)")
    return prompt
