"""The routes a request keeps for the tokens it has already been routed for (every platform).

A request's kept routes (``Req.megarl_kept_routes``, int32 [n, L, k]: the experts of positions
``[0, n)`` in every layer, in the engine's order) are the routes its prefix was computed with
before, which any later recomputation of those positions replays
(:mod:`megarl.engine_process.route_replay`), so that the tokens sampled after it see the context the
trainer's one forward with the recorded routes sees (docs/architecture.md, "Partial rollouts").
They come from two places:

- **the request**: a caller that resubmits a prefix (``abort_resubmit``'s continuation, a resumed
  run's partial sample) sends its recorded rows in the sampling parameters' ``custom_params`` under
  :data:`~megarl.wire.routes.ROUTES_PARAM` (:mod:`megarl.wire.routes`); :func:`create_request` takes
  them off the parameters into the request (a malformed entry aborts the request with HTTP 400 naming it);
- **a retraction**: SGLang 0.5.23 records each fed token's routed experts
  (``--enable-return-routed-experts``) in a host buffer indexed by the token's KV slot
  (``RoutedExpertsCapturer.on_forward_end``); a retracted request (a ``/pause_generation`` in mode
  ``retract``, a decode batch out of KV memory, a preemption) frees its KV slots in
  ``schedule_batch.release_req`` and is prefilled anew when scheduled again. Before the slots are
  freed, :func:`keep_fed_routes` appends the rows of the tokens fed since the last keep.

A kept prefix and SGLang's prefix cache: a cached prefix reused by the request must have been
computed with its kept routes, or the tokens after it see another context. The capturer's host
buffer holds the routes each cached KV slot was computed with; :func:`match_kv_cache` cuts the
request's prefix match at the first position whose cached routes differ from the kept ones (the
rest is recomputed, with the kept routes replayed). Positions past the kept rows reuse whatever
is cached, and the request reports the routes that computed it (the capturer's rows), which the
trainer then replays: one route per token, whichever request computed it.
"""
from __future__ import annotations

import torch

from megarl.wire.routes import ROUTES_PARAM, decode_routes

KEPT_ROUTES = "megarl_kept_routes"  # the Req attribute: int32 [n, L, k], rows of positions [0, n)

_original_release = None  # SGLang's functions, kept by install()
_original_create = None
_original_match = None


def take_request_routes(req, shape: tuple[int, int] | None, num_experts: int | None) -> None:
    """Move ``req``'s :data:`ROUTES_PARAM` entry, if any, from its sampling parameters to
    ``req.megarl_kept_routes``; a malformed one, or one the engine cannot replay (``shape`` (layers,
    top-k) None: routed experts not captured; ``num_experts`` None: not an MoE model it knows), aborts
    the request (HTTP 400, the reason)."""
    params = req.sampling_params
    custom = params.custom_params
    if not isinstance(custom, dict) or ROUTES_PARAM not in custom:
        return
    entry = custom[ROUTES_PARAM]
    params.custom_params = {k: v for k, v in custom.items() if k != ROUTES_PARAM} or None
    try:
        if shape is None or num_experts is None:
            raise ValueError(f"custom_params[{ROUTES_PARAM!r}]: this engine cannot replay routes (it needs "
                             "--enable-return-routed-experts and an MoE model with num_experts, n_routed_experts "
                             "or num_local_experts in its config)")
        setattr(req, KEPT_ROUTES, decode_routes(entry, shape, num_experts, len(req.origin_input_ids) - 1))
    except ValueError as e:
        req.set_finish_with_abort(str(e))


def create_request(scheduler, recv_req, *args, **kwargs):
    """SGLang's ``Scheduler._create_generation_req``, taking the request's kept routes off its
    parameters (:func:`take_request_routes`)."""
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    req = _original_create(scheduler, recv_req, *args, **kwargs)
    capturer = get_global_experts_capturer()
    config = scheduler.model_config.hf_text_config
    experts = next((getattr(config, name) for name in ("num_experts", "n_routed_experts", "num_local_experts")
                    if getattr(config, name, None)), None)
    take_request_routes(req, None if capturer is None else (capturer.num_layers, capturer.topk_size), experts)
    return req


def fed_tokens(req) -> int:
    """Tokens of ``req`` whose forward has run (the last sampled token is fed only by the next step)."""
    return min(req.kv.kv_committed_len, len(req.origin_input_ids) + len(req.output_ids) - 1)


def keep_fed_routes(req, req_to_token_pool) -> None:
    """Append to ``req.megarl_kept_routes`` the captured rows of the tokens fed since it was last
    kept; call it while ``req`` still holds its KV slots."""
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    capturer = get_global_experts_capturer()
    if capturer is None or not req.return_routed_experts or req.kv.req_pool_idx is None:
        return
    kept = getattr(req, KEPT_ROUTES, None)
    have, fed = (0 if kept is None else len(kept)), fed_tokens(req)
    if fed <= have:
        return
    fresh = capturer.get_topk(req_pool_idx=req.kv.req_pool_idx, seqlen=fed + 1,
                              req_to_token_pool=req_to_token_pool, start_len=have)  # rows [have, fed)
    setattr(req, KEPT_ROUTES, fresh if kept is None else torch.cat([kept, fresh]))


def release_req(*, req, req_to_token_pool, **kwargs):
    """SGLang's ``schedule_batch.release_req``, keeping the request's fed routes first."""
    keep_fed_routes(req, req_to_token_pool)
    return _original_release(req=req, req_to_token_pool=req_to_token_pool, **kwargs)


def agreeing_rows(cached: torch.Tensor, kept: torch.Tensor) -> int:
    """How many leading rows of ``cached`` (the routes of a matched prefix's slots, [m, L, k]) equal
    ``kept`` where it has rows: m when every kept row they share agrees, else the first that does not."""
    n = min(len(cached), len(kept))
    differs = (cached[:n] != kept[:n]).flatten(1).any(1).nonzero()
    return int(differs[0]) if len(differs) else len(cached)


def match_kv_cache(req, tree_cache, token_ids=None, **kwargs):
    """SGLang's ``mem_cache.common.match_kv_cache``, its match cut where the cached routes leave the
    request's kept ones (see the module docstring)."""
    result = _original_match(req, tree_cache, token_ids, **kwargs)
    kept = getattr(req, KEPT_ROUTES, None)
    if kept is None or req.prefix_len == 0:
        return result
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    capturer = get_global_experts_capturer()
    if capturer is None:
        return result
    slots = tree_cache.prefix_device_indices(req).cpu()
    agree = agreeing_rows(capturer.host_cache.buffer[slots], kept)
    if agree >= req.prefix_len:
        return result
    limit = agree if kwargs.get("max_prefix_len") is None else min(agree, kwargs["max_prefix_len"])
    return _original_match(req, tree_cache, token_ids, **{**kwargs, "max_prefix_len": limit})


def install() -> None:
    """Route SGLang's request creation, request release and prefix match in this process through
    :func:`create_request`, :func:`release_req` and :func:`match_kv_cache` (idempotent)."""
    global _original_release, _original_create, _original_match
    from sglang.srt.managers import schedule_batch, schedule_policy
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache import common

    if schedule_batch.release_req is release_req:
        return
    _original_release = schedule_batch.release_req
    _original_create = Scheduler._create_generation_req
    _original_match = common.match_kv_cache
    schedule_batch.release_req = release_req  # retract_all and ScheduleBatch.release_req call the global
    Scheduler._create_generation_req = create_request
    for module in (common, schedule_batch, schedule_policy):  # each calls it by the name it imported
        module.match_kv_cache = match_kv_cache
