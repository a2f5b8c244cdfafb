"""The one async HTTP client for SGLang engine traffic: generation with routing and sampling-mask
metadata, pause/continue/abort, weight versions, weight updates from disk, and the release of the
engine's memory (colocated placement).

Weight versions are integers in megarl (the trainer step that produced the weights); the engine
holds them as strings (``--weight-version``, ``/update_weight_version``) and reports the version of
every generated token as spans, which become ``RolloutSample.model_version``.

A request paused ``in_place`` across a weight update keeps the KV cache the previous weights computed,
so its later tokens come from a forward that mixes two versions; so may a request started after it
that reuses a cached prefix (an ``in_place`` update leaves the prefix cache unflushed, until the
next :meth:`SGLangClient.flush_cache`). The client remembers which version labels it set while the
engine was paused in place and marks those tokens (``RolloutSample.mixed_versions``,
:func:`mixed_version_tokens`); a ``retract`` pause recomputes the cache under the new weights, so
tokens after it are not mixed. Pauses and weight updates must go through the client that generates
(``EnginePool`` and ``megarl.sync`` use the pool's clients).

A batch that repeats a prompt of ``shared_prefill_min_tokens`` or more (a GRPO group's) is preceded by
one request that prefills each such prompt once (:meth:`SGLangClient._prefill_shared`).

A prompt that resubmits a prefix (``abort_resubmit``'s continuation, a resumed partial sample) can carry
the routes its tokens were computed with (``prefix_routes``): the engine replays them when it computes
the prompt (:mod:`megarl.engine_process.route_replay`), so the new tokens see the context the trainer's
forward replays. Such a prompt is left out of the shared prefill, which would route it afresh.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import numpy as np
import pybase64

from megarl.engines.coalesce import BatchCoalescer
from megarl.engines.types import (
    BatchResult,
    EngineError,
    EngineUnreachable,
    LoraAdapter,
    PauseMode,
    SamplingParams,
    ServedModel,
)
from megarl.sample import FinishReason, RolloutSample, SamplingMask
from megarl.wire.metadata import COMPACT, HEADER, compact_arrays, expert_dtype, unpack_answer
from megarl.wire.routes import ROUTES_PARAM, encode_routes

log = logging.getLogger(__name__)


# The memory regions an engine can release (SGLang's tags; its third, cuda_graph, is left mapped).
MEMORY_TAGS = ("weights", "kv_cache")


# A pooled connection idle this long is dropped, not reused. A server closes a connection idle for its
# keep-alive timeout (SGLang's uvicorn: ``SGLANG_TIMEOUT_KEEP_ALIVE``, 5 s by default); a request sent on it
# as that timer fires is never read and fails with a ReadError, though the engine is healthy. httpx's own
# limit is the same 5 s, so a connection idle for just under it raced the server's close; below it, none does.
IDLE_CONNECTION_S = 2.0

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED}


def _rejected_by_the_engine(error: BaseException) -> bool:
    """An answer of the engine (an HTTP error, bad metadata), not a failure to reach it."""
    return isinstance(error, EngineError) and not isinstance(error, EngineUnreachable)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header that authenticates a request to an engine started with ``api_key`` (none without)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def engine_limits() -> httpx.Limits:
    """The connection pool's limits of a client of an engine: httpx's, idle connections dropped after
    ``IDLE_CONNECTION_S``."""
    return httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=IDLE_CONNECTION_S)


def parse_weight_version(version: str) -> int:
    """megarl's integer version from the engine's string; a clear error for foreign versions."""
    try:
        return int(version)
    except ValueError:
        raise EngineError(
            f"engine weight version {version!r} is not an integer; start the engine with "
            "--weight-version <int> (megarl's SGLangEngine does)"
        ) from None


def decode_routed_experts(b64: str, num_tokens: int, model: ServedModel) -> np.ndarray:
    """SGLang's base64 int32 routing -> [num_tokens - 1, num_layers, topk] in ``model.routing_dtype``."""
    flat = np.frombuffer(pybase64.b64decode(b64), dtype=np.int32)
    shape = (num_tokens - 1, model.num_layers, model.topk)
    if flat.size != shape[0] * shape[1] * shape[2]:
        raise EngineError(f"routed_experts holds {flat.size} ids, expected {shape} for {num_tokens} tokens")
    # one pass: a negative id read as uint32 is above every expert
    if flat.size and flat.view(np.uint32).max() >= model.num_experts:
        raise EngineError(f"routed_experts ids outside [0, {model.num_experts}): {flat.min()}..{flat.max()}")
    return flat.reshape(shape).astype(model.routing_dtype)


def _model_versions(meta: dict, num_response: int) -> np.ndarray:
    """Per-token int32 versions from the engine's spans [{"version", "start", "end"}, ...]."""
    spans = meta["weight_versions"]
    if len(spans) == 1 and spans[0]["start"] == 0 and spans[0]["end"] == num_response:  # one version throughout
        return np.full(num_response, parse_weight_version(spans[0]["version"]), dtype=np.int32)
    versions = np.zeros(num_response, dtype=np.int32)
    covered = np.zeros(num_response, dtype=bool)
    for span in meta["weight_versions"]:
        versions[span["start"] : span["end"]] = parse_weight_version(span["version"])
        covered[span["start"] : span["end"]] = True
    if not covered.all():
        raise EngineError(f"weight_versions spans {meta['weight_versions']} do not cover {num_response} tokens")
    return versions


def mixed_version_tokens(versions: np.ndarray, entered_in_place: Mapping[int, bool],
                         cached_prefix: bool) -> np.ndarray | None:
    """bool [R] over a response's per-token ``versions`` (int32 [R]): True from each change into a
    version that ``entered_in_place`` says was labelled while the engine was paused in place (and
    its cache not flushed since) up to the next change into one that was not, and from the first
    token when that is of such a version and the request reused a ``cached_prefix``; None when no
    token is mixed."""
    if not any(entered_in_place.values()):  # no version was labelled in place: nothing can be mixed
        return None
    mixed = np.zeros(len(versions), dtype=bool)
    changes = np.flatnonzero(np.diff(versions)) + 1
    if cached_prefix and len(versions):
        changes = np.concatenate([[0], changes])
    for start, end in zip(changes, [*changes[1:], len(versions)]):
        mixed[start:end] = entered_in_place.get(int(versions[start]), False)
    return mixed if mixed.any() else None


def generate_payload(prompts: list[list[int]] | list[int], params: SamplingParams, return_routed_experts: bool,
                     return_sampling_mask: bool, support_logprobs: bool = False,
                     prefix_routes: Sequence[np.ndarray | None] = ()) -> dict:
    """The ``/generate`` body of a batch of token-id prompts (or one prompt): per-token log-probs always, routed
    experts and the sampling mask (with the log-probs of the sampling distribution: of the sampled token, or
    with ``support_logprobs`` of every kept id, SGLang's ``sampling_logprobs_mode`` ``support``) as asked, at
    ``params.priority`` in the engine's queue (unless the default, 0); a
    prompt's ``prefix_routes`` (when given and not None) ride in its own sampling parameters, for the engine to
    replay (:func:`megarl.wire.routes.encode_routes`)."""
    sampling = params.to_json()
    if any(r is not None for r in prefix_routes):
        sampling = [sampling if r is None else {**sampling, "custom_params": {ROUTES_PARAM: encode_routes(r)}}
                    for r in prefix_routes]
    payload = {"input_ids": prompts, "sampling_params": sampling, "return_logprob": True,
               "return_routed_experts": return_routed_experts, "return_sampling_mask": return_sampling_mask}
    if params.priority:
        payload["priority"] = params.priority
    if return_sampling_mask:
        payload["sampling_logprobs_mode"] = "support" if support_logprobs else "selected"
    return payload


def sampling_mask_of(rows: list, logprobs: list, response_ids: list[int],
                     support: bool) -> tuple[SamplingMask, list[float]]:
    """The response's sampling mask from the engine's per-token ``rows`` of kept ids and ``logprobs`` (one
    value per token, or with ``support`` one per kept id), and each sampled token's log-prob."""
    if not support:
        return SamplingMask.from_rows(rows), list(logprobs)
    mask = SamplingMask.from_rows(rows, logprobs)
    selected = []
    for i, token in enumerate(response_ids):
        at = np.flatnonzero(mask.row(i) == token)
        if not len(at):
            raise EngineError(f"response token {i} ({token}) is not in its recorded sampling support")
        selected.append(float(mask.logprobs[mask.offsets[i] + at[0]]))
    return mask, selected


def shared_prompts(prompts: list[list[int]], min_tokens: int, prefix_routes: Sequence[np.ndarray | None] = ()
                   ) -> list[int]:
    """Positions of the first copy of each prompt that occurs more than once in ``prompts`` and has at
    least ``min_tokens`` tokens, in order; none when ``min_tokens`` is 0 (off). Prompts with
    ``prefix_routes`` (not None) are not counted: they are computed with their own routes."""
    if min_tokens == 0:
        return []
    first: dict[tuple[int, ...], int] = {}
    shared: set[int] = set()
    for i, prompt in enumerate(prompts):
        if len(prompt) < min_tokens or (i < len(prefix_routes) and prefix_routes[i] is not None):
            continue
        j = first.setdefault(tuple(prompt), i)
        if j != i:
            shared.add(j)
    return sorted(shared)


MetadataAsked = tuple[bool, bool, bool, bool]  # (routes, sampling mask, never ran, support log-probs)
Metadata = tuple[np.ndarray, "SamplingMask | None", "np.ndarray | None"]  # log-probs, mask, routes


def json_metadata(meta: dict, response_ids: list[int], prompt_len: int, model: ServedModel,
                  asked: MetadataAsked) -> Metadata:
    """A response's log-probs (float32 [R]), sampling mask and routes ([T-1, L, k] in ``model.routing_dtype``)
    from SGLang's JSON fields (a request sent without :data:`~megarl.wire.metadata.HEADER`)."""
    with_routing, with_mask, never_ran, support = asked
    request = meta.get("id")
    token_logprobs = meta["output_token_logprobs"]
    if [t[1] for t in token_logprobs] != response_ids:
        raise EngineError(f"output_token_logprobs ids disagree with output_ids for request {request}")
    if with_mask:
        logprobs = meta.get("output_token_sampling_logprobs", [] if never_ran else None)
        rows = meta.get("output_token_sampling_mask", [] if never_ran else None)
        if logprobs is None or rows is None:
            raise EngineError(f"request {request} asked for a sampling mask but got none")
        mask, logprobs = sampling_mask_of(rows, logprobs, response_ids, support)
    else:
        logprobs, mask = [t[0] for t in token_logprobs], None
    routing = None
    if with_routing:
        if "routed_experts" not in meta:
            raise EngineError(f"request {request} asked for routed experts but got none "
                              "(is the server started with --enable-return-routed-experts?)")
        routing = decode_routed_experts(meta["routed_experts"], prompt_len + len(response_ids), model)
    return np.asarray(logprobs, dtype=np.float32), mask, routing


def compact_metadata(meta: dict, section: memoryview, response_ids: list[int], prompt_len: int, model: ServedModel,
                     asked: MetadataAsked) -> Metadata:
    """:func:`json_metadata` from a binary answer's arrays (:mod:`megarl.wire.metadata`, the
    array ``section``): the same values, views of the section, routes in ``expert_dtype(model.num_experts)``."""
    with_routing, with_mask, never_ran, support = asked
    request, r = meta.get("id"), len(response_ids)
    try:
        arrays = compact_arrays(meta[COMPACT], section)
    except ValueError as e:
        raise EngineError(f"request {request}: {e}") from None
    if "routed_experts" in arrays and arrays["routed_experts"].dtype != expert_dtype(model.num_experts):
        raise EngineError(f"request {request}: routed experts as {arrays['routed_experts'].dtype}, "
                          f"expected {expert_dtype(model.num_experts)}")
    mask = None
    if with_mask and never_ran:
        mask, logprobs = SamplingMask(np.zeros(0, np.int32), np.zeros(1, np.int32)), np.zeros(0, np.float32)
    elif with_mask:
        if "mask_ids" not in arrays:
            raise EngineError(f"request {request} asked for a sampling mask but got none")
        mask, logprobs = compact_sampling_mask(arrays, response_ids, support)
    else:
        logprobs = arrays.get("logprobs", np.zeros(0, np.float32))
    if len(logprobs) != r:
        raise EngineError(f"request {request}: {len(logprobs)} log-probs for {r} response tokens")
    routing = None
    if with_routing:
        if "routed_experts" not in arrays:
            raise EngineError(f"request {request} asked for routed experts but got none "
                              "(is the server started with --enable-return-routed-experts?)")
        routing = checked_routes(arrays["routed_experts"], prompt_len + r, model)
    return logprobs, mask, routing


def compact_sampling_mask(arrays: dict[str, np.ndarray], response_ids: list[int],
                          support: bool) -> tuple[SamplingMask, np.ndarray]:
    """The sampling mask (CSR, int32) and each sampled token's log-prob (float32 [R]) from the compact
    arrays ``mask_lengths``, ``mask_ids`` and ``mask_logprobs`` ([R], or [nnz] with ``support``)."""
    lengths, ids, values = arrays["mask_lengths"], arrays["mask_ids"], arrays["mask_logprobs"]
    if len(lengths) != len(response_ids):
        raise EngineError(f"a sampling mask of {len(lengths)} rows for {len(response_ids)} response tokens")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] != len(ids):
        raise EngineError(f"sampling mask rows hold {offsets[-1]} ids, the response sent {len(ids)}")
    if not support:
        return SamplingMask(ids, offsets), values
    if len(values) != len(ids):
        raise EngineError(f"{len(values)} support log-probs for {len(ids)} kept ids")
    rows = np.repeat(np.arange(len(lengths)), lengths)
    hits = np.flatnonzero(ids == np.repeat(np.asarray(response_ids, dtype=np.int32), lengths))
    found, first = np.unique(rows[hits], return_index=True)  # each row's first kept id that is its token
    if len(found) != len(lengths):
        i = int(np.flatnonzero(~np.isin(np.arange(len(lengths)), found))[0])
        raise EngineError(f"response token {i} ({response_ids[i]}) is not in its recorded sampling support")
    return SamplingMask(ids, offsets, values), values[hits[first]]


def checked_routes(flat: np.ndarray, num_tokens: int, model: ServedModel) -> np.ndarray:
    """``flat`` expert ids as [num_tokens - 1, num_layers, topk]; EngineError for another count or an id
    outside ``[0, model.num_experts)``."""
    shape = (num_tokens - 1, model.num_layers, model.topk)
    if flat.size != shape[0] * shape[1] * shape[2]:
        raise EngineError(f"routed_experts holds {flat.size} ids, expected {shape} for {num_tokens} tokens")
    signed = flat.dtype.kind == "i"  # unsigned ids cannot be negative: one pass fewer
    if flat.size and ((signed and flat.min() < 0) or flat.max() >= model.num_experts):
        raise EngineError(f"routed_experts ids outside [0, {model.num_experts}): {flat.min()}..{flat.max()}")
    return flat.reshape(shape)


class SGLangClient:
    """Async client of one SGLang HTTP server. Use ``async with`` or call ``aclose()``.

    ``api_key``: the server's ``--api-key``, sent as ``Authorization: Bearer`` on every request
    (generation, control and weight updates alike); it is never logged. ``compact_metadata``: ask for the
    per-token metadata as binary arrays (:mod:`megarl.wire.metadata`, decoded by
    :func:`compact_metadata`); False: SGLang's JSON fields (:func:`json_metadata`), the same values."""

    def __init__(self, base_url: str, model: ServedModel, request_timeout_s: float = 600.0,
                 api_key: str | None = None, shared_prefill_min_tokens: int = 0, support_logprobs: bool = False,
                 compact_metadata: bool = True):
        if shared_prefill_min_tokens < 0:
            raise ValueError(f"shared_prefill_min_tokens must be >= 0 (0: off), got {shared_prefill_min_tokens}")
        self.base_url = base_url
        self.model = model
        self.shared_prefill_min_tokens = shared_prefill_min_tokens  # see _prefill_shared
        # a sampling mask comes with the engine's log-prob of every kept id (SamplingMask.logprobs)
        self.support_logprobs = support_logprobs
        # responses carry the per-token metadata as binary arrays (compact_metadata), or as SGLang's JSON
        headers = auth_headers(api_key) | ({HEADER: expert_dtype(model.num_experts).name} if compact_metadata else {})
        self._http = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(request_timeout_s, connect=10.0),
                                       headers=headers, limits=engine_limits())
        # the LoRA adapter requests name (None: the base weights), set by megarl.sync.adapter
        self.adapter: LoraAdapter | None = None
        # concurrent generate_batch calls go out as one request; a rejection is retried call by call
        self._batches = BatchCoalescer(self._generate_batch_now, isolate=_rejected_by_the_engine)
        self._paused: PauseMode | None = None  # the mode of the pause in force, None while generating
        # weight version -> whether it was last labelled while paused in place, its cache not flushed
        # since (mixed_version_tokens); and the version labelled last
        self._entered_in_place: dict[int, bool] = {}
        self._label: int | None = None
        self._has_tokenizer: bool | None = None  # the engine's, read from /server_info by the first need

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._batches.aclose()
        await self._http.aclose()

    async def _post(self, path: str, payload: dict) -> httpx.Response:
        return await self._request("POST", path, payload)

    async def _request(self, method: str, path: str, payload: dict | None = None) -> httpx.Response:
        try:
            response = await self._http.request(method, path, json=payload)
        except httpx.TransportError as e:
            raise EngineUnreachable(f"{self.base_url}{path}: engine unreachable ({type(e).__name__}: {e})") from e
        if response.status_code != 200:
            raise EngineError(f"{self.base_url}{path}: HTTP {response.status_code}: {_error_message(response)}")
        return response

    async def _check_text_params(self, params: SamplingParams) -> None:
        """Refuse ``params`` with stop strings or a grammar (ValueError) when the engine runs without its
        tokenizer (``EngineSettings.tokenizer`` False), which both need."""
        if not (params.stop or params.grammar):
            return
        if self._has_tokenizer is None:
            info = (await self._request("GET", "/server_info")).json()
            self._has_tokenizer = not info.get("skip_tokenizer_init", False)
        if not self._has_tokenizer:
            raise ValueError(f"{self.base_url} runs without its tokenizer (--skip-tokenizer-init, a single-turn "
                             f"run's policy engine): it cannot apply stop strings {list(params.stop)} or a grammar")

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt: prompt_ids has no tokens")
        bad = [i for i in prompt_ids if not 0 <= i < self.model.vocab_size]
        if bad:
            # SGLang 0.5.23 crashes the whole server on an out-of-vocabulary id instead of rejecting it.
            raise ValueError(f"prompt_ids outside the vocabulary [0, {self.model.vocab_size}): {bad[:8]}")

    async def generate_batch_counted(self, prompts: list[list[int]], params: SamplingParams, *, group_ids: list[str],
                                     return_routed_experts: bool = True, return_sampling_mask: bool = True,
                                     affinity: Sequence[str | None] | None = None,
                                     prefix_routes: Sequence[np.ndarray | None] | None = None) -> BatchResult:
        """:meth:`generate_batch` as a :class:`BatchResult` (one engine resubmits nothing)."""
        samples = await self.generate_batch(prompts, params, group_ids=group_ids,
                                            return_routed_experts=return_routed_experts,
                                            return_sampling_mask=return_sampling_mask, prefix_routes=prefix_routes)
        return BatchResult(samples, 0)

    async def generate_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        group_ids: list[str],
        return_routed_experts: bool = True,
        return_sampling_mask: bool = True,
        affinity: Sequence[str | None] | None = None,
        prefix_routes: Sequence[np.ndarray | None] | None = None,
    ) -> list[RolloutSample]:
        """One response per prompt, sent as one request (SGLang batches it), joined with the other calls of
        this event-loop turn that share ``params`` and the flags (:mod:`megarl.engines.coalesce`).
        ``rollout_logprobs`` are of the temperature-scaled distribution (softmax of logits / temperature),
        renormalised over the sampling mask when it is returned. Raises ValueError for bad input (empty
        prompt, ids outside the vocabulary, a mask without a finite top_k, stop strings or a grammar for an
        engine without its tokenizer) and EngineError when the engine rejects the request (e.g. a prompt
        longer than the context) or is unreachable; an aborted request returns its partial response.
        ``affinity`` keys are met by construction (one engine serves
        every request). ``prefix_routes[i]`` (integer [n, L, k], n < len(prompts[i]), or None): the
        routes prompt ``i``'s first n tokens were computed with, replayed by the engine (ValueError for a
        shape or an expert id the served model does not have)."""
        if len(group_ids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(group_ids)} group ids")
        routes = [None] * len(prompts) if prefix_routes is None else list(prefix_routes)
        if len(routes) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(routes)} prefix routes")
        for prompt_ids, prompt_routes in zip(prompts, routes):
            self._validate_prompt(prompt_ids)
            self._validate_routes(prompt_ids, prompt_routes)
        if return_sampling_mask and params.top_k <= 0:
            raise ValueError("return_sampling_mask needs a finite top_k (<= the engine's --sampling-mask-max-tokens)")
        await self._check_text_params(params)
        return await self._batches.submit([(list(p), r) for p, r in zip(prompts, routes)], list(group_ids),
                                          (params, return_routed_experts, return_sampling_mask))

    def _validate_routes(self, prompt_ids: list[int], routes: np.ndarray | None) -> None:
        """ValueError unless ``routes`` is None or [n, L, k] expert ids of the served model for n < the
        prompt's length (its last token has no row)."""
        if routes is None:
            return
        m = self.model
        if routes.ndim != 3 or routes.shape[1:] != (m.num_layers, m.topk) or not 0 < len(routes) < len(prompt_ids):
            raise ValueError(f"prefix routes of shape {routes.shape} for a prompt of {len(prompt_ids)} tokens: "
                             f"expected [n, {m.num_layers}, {m.topk}] with 0 < n < {len(prompt_ids)}")
        if routes.size and not (routes.min() >= 0 and routes.max() < m.num_experts):
            raise ValueError(f"prefix routes hold expert ids outside [0, {m.num_experts})")

    async def _generate_batch_now(self, items: list[tuple[list[int], np.ndarray | None]], group_ids: list[str],
                                  key: tuple) -> list[RolloutSample]:
        """One ``/generate`` request for ``items`` ((prompt, prefix routes or None), validated); ``key`` =
        (params, routing, mask flags)."""
        params, return_routed_experts, return_sampling_mask = key
        prompts, routes = [p for p, _ in items], [r for _, r in items]
        payload = generate_payload(prompts, params, return_routed_experts, return_sampling_mask, self.support_logprobs,
                                   routes)
        adapter = self._name_adapter(payload)
        firsts = shared_prompts(prompts, self.shared_prefill_min_tokens, routes)
        cached_first = (await self._prefill_shared([prompts[i] for i in firsts], adapter, params.priority)
                        if firsts else [])
        body = (await self._post("/generate", payload)).content
        samples = self.samples_of(body, prompts, group_ids, (return_routed_experts, return_sampling_mask), adapter)
        for i, cached in zip(firsts, cached_first):  # the prefill's prompt tokens count as the first copy's
            samples[i].prefill_tokens += len(prompts[i])
            samples[i].cached_tokens += cached
        return samples

    async def _prefill_shared(self, prompts: list[list[int]], adapter: LoraAdapter | None,
                              priority: int = 0) -> list[int]:
        """Prefill ``prompts`` (each shared by several requests of a batch about to be sent) in one
        request that generates nothing, so that their copies in the batch find them in the engine's
        prefix cache: SGLang prefills the requests of one batch side by side (its default ``fcfs``
        policy shares no prefix inside a batch), so a GRPO group's G copies of a prompt would each
        compute it. Returns each prompt's ``cached_tokens``. SGLang's parallel sampling (``n`` > 1,
        tokenizer_manager ``_handle_batch_request``) prefills a prompt first the same way, one prompt
        at a time. ``priority``: the batch's (its place in the engine's queue)."""
        payload = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 0}}
        if priority:
            payload["priority"] = priority
        if adapter is not None:  # the adapter is part of the prefix cache's key
            payload["lora_path"] = adapter.name
        outs, _ = unpack_answer((await self._post("/generate", payload)).content)
        return [int(out["meta_info"].get("cached_tokens", 0)) for out in outs]

    def _name_adapter(self, payload: dict) -> LoraAdapter | None:
        """Name the current adapter in a generate ``payload``; returns it (None: the base weights)."""
        adapter = self.adapter
        if adapter is not None:
            payload["lora_path"] = adapter.name
        return adapter

    def samples_of(self, body: bytes, prompts: list[list[int]], group_ids: list[str], asked: tuple[bool, bool],
                   adapter: LoraAdapter | None = None) -> list[RolloutSample]:
        """The samples of a batch ``/generate`` answer ``body`` (JSON or binary,
        :func:`~megarl.wire.metadata.unpack_answer`) to ``prompts``; ``asked``: whether routes
        and sampling masks were asked for; ``adapter``: the one the request named."""
        outs, section = unpack_answer(body)
        return [self._to_sample(p, out, *asked, g, "", adapter, section) for p, out, g in zip(prompts, outs, group_ids)]

    def _to_sample(self, prompt_ids, out, with_routing, with_mask, group_id, episode_id,
                   adapter: LoraAdapter | None = None, section: memoryview | None = None) -> RolloutSample:
        meta = out["meta_info"]
        response_ids = list(out["output_ids"])
        r = len(response_ids)
        finish = meta["finish_reason"]
        if finish is None or finish["type"] not in _FINISH_REASONS:
            raise EngineError(f"unknown finish_reason {finish!r} for request {meta.get('id')}")
        # A request aborted before it was scheduled comes back with no tokens and no metadata.
        never_ran = r == 0 and finish["type"] == "abort"
        asked = (with_routing and not never_ran, with_mask, never_ran, self.support_logprobs)
        if COMPACT in meta and section is not None:
            logprobs, mask, routing = compact_metadata(meta, section, response_ids, len(prompt_ids), self.model, asked)
        else:
            logprobs, mask, routing = json_metadata(meta, response_ids, len(prompt_ids), self.model, asked)
        # a request keeps the adapter it named to its end: every token is that adapter's version
        versions = _model_versions(meta, r) if adapter is None else np.full(r, adapter.version, dtype=np.int32)
        return RolloutSample(
            prompt_ids=prompt_ids, response_ids=response_ids, loss_mask=np.ones(r, dtype=np.uint8),
            rollout_logprobs=logprobs, model_version=versions, routed_experts=routing, sampling_mask=mask,
            finish_reason=_FINISH_REASONS[finish["type"]], group_id=group_id, episode_id=episode_id,
            mixed_versions=mixed_version_tokens(versions, self._entered_in_place, meta.get("cached_tokens", 0) > 0),
            prefill_tokens=len(prompt_ids), cached_tokens=int(meta.get("cached_tokens", 0)),
        )

    async def pause_generation(self, mode: PauseMode = PauseMode.ABORT) -> None:
        """Pause the engine. Every open generate response must be read, or this never returns.
        With requests in flight an ABORT pause takes about a second (SGLang 0.5.23 aborts them and
        polls its request lock once a second until they have returned); RETRACT and IN_PLACE
        return once the scheduler has paused."""
        await self._post("/pause_generation", {"mode": PauseMode(mode).value})
        self._paused = PauseMode(mode)
        log.info("%s: generation paused (%s)", self.base_url, PauseMode(mode).value)

    async def continue_generation(self) -> None:
        await self._post("/continue_generation", {})
        self._paused = None
        log.info("%s: generation continued", self.base_url)

    async def abort_all_requests(self) -> None:
        """Abort every request the engine's scheduler holds (each ``generate_batch`` call returns its
        partial response); requests still waiting in a paused engine are not reached."""
        await self._post("/abort_request", {"abort_all": True})

    async def weight_version(self) -> int:
        """The version label of the engine's current weights."""
        response = await self._request("GET", "/model_info")
        return parse_weight_version(response.json()["weight_version"])

    async def set_weight_version(self, version: int, abort_all_requests: bool = False) -> None:
        """Label the engine's current weights ``version`` (for tokens generated from now on)."""
        await self._post("/update_weight_version",
                         {"new_version": str(int(version)), "abort_all_requests": abort_all_requests})
        self._labelled(version)

    def _labelled(self, version: int | None) -> None:
        """Note that the engine's weights now carry ``version`` (None: the label stayed), and
        whether the engine was paused in place when they took it."""
        if version is not None:
            self._label = int(version)
            self._entered_in_place[self._label] = self._paused is PauseMode.IN_PLACE

    async def update_weights_from_disk(self, model_path: str | Path, version: int, flush_cache: bool = True) -> None:
        """Load an HF checkpoint directory into the engine and label it ``version``.

        Wrapped in the begin/end weight-update session that SGLang 0.5.23 requires. Called between
        ``pause_generation(RETRACT)`` and ``continue_generation``, the paused requests resume on the
        new weights and their tokens carry the version that produced each of them.
        """
        await self._post("/begin_weight_update", {})
        try:
            await self._post("/update_weights_from_disk", {
                "model_path": str(model_path), "weight_version": str(int(version)), "flush_cache": flush_cache})
        finally:
            await self._post("/end_weight_update", {})
        self._labelled(version)
        log.info("%s: weights from %s loaded as version %d", self.base_url, model_path, version)

    # --- weight-update session primitives (megarl.sync drives them) --------------------------------
    async def begin_weight_update(self) -> None:
        """Open the engine's weight-update session (SGLang 0.5.23 loads weights only inside one)."""
        await self._post("/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        """Close the weight-update session (the engine finalises the loaded weights)."""
        await self._post("/end_weight_update", {})

    async def flush_cache(self) -> None:
        """Drop the radix/KV cache computed by the previous weights (refused while requests run)."""
        await self._post("/flush_cache", {})
        if self._label is not None:  # no request and no cached prefix left from earlier weights
            self._entered_in_place[self._label] = False

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        """Join the process group ``group_name`` (rank ``rank_offset`` + engine TP rank); returns
        once every member has joined, so the trainer's side must join concurrently."""
        await self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name})

    # The three loads below run inside an open weight-update session. ``weight_version`` (None: the
    # label stays) and ``flush_cache`` ride on the call: the engine records the version and flushes
    # the cache right after loading, in the same round trip. The flush skips SGLang's
    # ``torch_empty_cache`` (off by default in update requests; /flush_cache runs it, which on CPU
    # is a gc.collect() of the scheduler's heap).
    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, load_format: str | None = None,
                                              weight_version: int | None = None, flush_cache: bool = False) -> None:
        """Receive tensors (``load_format="flattened_bucket"``: one flat buffer) broadcast by rank 0
        of ``group_name`` and load them."""
        await self._post("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "load_format": load_format, **_update_fields(weight_version, flush_cache)})
        self._labelled(weight_version)

    async def update_weights_from_tensor(self, serialized: list[str], load_format: str | None = None,
                                         weight_version: int | None = None, flush_cache: bool = False) -> None:
        """Load tensors another process on this machine shares (``serialized``: one base64
        ``MultiprocessingSerializer`` payload per engine TP rank)."""
        await self._post("/update_weights_from_tensor", {
            "serialized_named_tensors": serialized, "load_format": load_format,
            **_update_fields(weight_version, flush_cache)})
        self._labelled(weight_version)

    async def load_weights_from_disk(self, model_path: str | Path, weight_version: int | None = None,
                                     flush_cache: bool = False) -> None:
        """Load an HF checkpoint directory."""
        await self._post("/update_weights_from_disk", {"model_path": str(model_path),
                                                       **_update_fields(weight_version, flush_cache)})
        self._labelled(weight_version)

    # --- LoRA adapters (engines started with --enable-lora; megarl.sync.adapter drives them) -------
    async def load_lora_adapter(self, name: str, path: str | Path) -> None:
        """Load the HF PEFT directory ``path`` as adapter ``name`` (requests then name it to use it)."""
        await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    async def unload_lora_adapter(self, name: str) -> None:
        await self._post("/unload_lora_adapter", {"lora_name": name})

    # --- memory release (colocated placement; megarl.pipeline.colocate drives it) ----------------
    async def memory_saver_enabled(self) -> bool:
        """Whether the engine can release its memory: started with ``--enable-memory-saver``
        (torch_memory_saver, CUDA only). Without it SGLang's release frees nothing on a GPU, and on
        CPU (SGLang 0.5.23) ``/release_memory_occupation`` kills the engine's scheduler: it ends with
        ``torch.cuda.synchronize()``."""
        response = await self._request("GET", "/server_info")
        return bool(response.json().get("enable_memory_saver", False))

    async def server_info(self) -> dict:
        """The engine's resolved server arguments and scheduler state (SGLang's ``/server_info``)."""
        return (await self._request("GET", "/server_info")).json()

    async def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free the memory regions ``tags`` (``weights``, ``kv_cache``) until :meth:`resume_memory`.
        The engine must be paused with nothing running (SGLang asserts it is idle). Released
        weights come back uninitialised: sync the weights after resuming them."""
        await self._post("/release_memory_occupation", {"tags": _memory_tags(tags)})
        log.info("%s: memory released (%s)", self.base_url, ", ".join(tags))

    async def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Map the regions ``tags`` that :meth:`release_memory` freed again (an error for a region
        that was not released)."""
        await self._post("/resume_memory_occupation", {"tags": _memory_tags(tags)})
        log.info("%s: memory resumed (%s)", self.base_url, ", ".join(tags))


def _update_fields(weight_version: int | None, flush_cache: bool) -> dict:
    """The version and flush fields of an SGLang weight-update request."""
    fields = {"flush_cache": bool(flush_cache)}
    if weight_version is not None:
        fields["weight_version"] = str(int(weight_version))
    return fields


def _memory_tags(tags: Sequence[str]) -> list[str]:
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown or not tags:
        raise ValueError(f"memory tags must be some of {', '.join(MEMORY_TAGS)}, got {list(tags)}")
    return list(tags)


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return error["message"]
    return str(body)[:500]
