"""A retracted request keeps the routed experts its tokens were generated with (every platform).

SGLang 0.5.23 records each fed token's routed experts (``--enable-return-routed-experts``) in a host
buffer indexed by the token's KV slot (``RoutedExpertsCapturer.on_forward_end``) and reads a
request's rows through its ``req_to_token`` row when it finishes (``get_topk``, called by
``SchedulerBatchResultProcessor._maybe_collect_routed_experts``). A retracted request (a
``/pause_generation`` in mode ``retract``, a decode batch out of KV memory, a preemption) frees its
KV slots in ``schedule_batch.release_req``; scheduled again, its prompt and output so far are
prefilled anew and their rows overwritten by the routes of that recomputation, under the new weights
after a weight update, while the log-probs and sampling masks of those tokens stay the ones they were
sampled with.

:func:`install` keeps the routes of generation: before ``release_req`` frees a request's slots,
:func:`keep_fed_routes` copies the rows of the tokens fed so far onto the request
(``Req.megarl_fed_routes``, int32 [fed, L, k], extended over repeated retractions), and when the
request's routes are collected :func:`collect_routed_experts` puts these rows in place of the
recomputed ones. Rows of tokens first fed after a retraction are the engine's as it captured them.
"""
from __future__ import annotations

import torch

FED_ROUTES = "megarl_fed_routes"  # the Req attribute holding the kept rows

_original_release = None  # SGLang's functions, kept by install()
_original_collect = None


def fed_tokens(req) -> int:
    """Tokens of ``req`` whose forward has run (the last sampled token is fed only by the next step)."""
    return min(req.kv.kv_committed_len, len(req.origin_input_ids) + len(req.output_ids) - 1)


def keep_fed_routes(req, req_to_token_pool) -> None:
    """Append to ``req.megarl_fed_routes`` the captured rows of the tokens fed since it was last
    kept; call it while ``req`` still holds its KV slots."""
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    capturer = get_global_experts_capturer()
    if capturer is None or not req.return_routed_experts or req.kv.req_pool_idx is None:
        return
    kept = getattr(req, FED_ROUTES, None)
    have, fed = (0 if kept is None else len(kept)), fed_tokens(req)
    if fed <= have:
        return
    fresh = capturer.get_topk(req_pool_idx=req.kv.req_pool_idx, seqlen=fed + 1,
                              req_to_token_pool=req_to_token_pool, start_len=have)  # rows [have, fed)
    setattr(req, FED_ROUTES, fresh if kept is None else torch.cat([kept, fresh]))


def overlay_kept_routes(routed: torch.Tensor, kept: torch.Tensor, start_len: int) -> torch.Tensor:
    """``routed`` (rows ``[start_len, start_len + len(routed))`` of a sequence) with every row that
    ``kept`` (rows ``[0, len(kept))``) holds replaced by the kept one; changes ``routed`` in place."""
    end = min(len(kept), start_len + len(routed))
    if end > start_len:
        routed[: end - start_len] = kept[start_len:end]
    return routed


def release_req(*, req, req_to_token_pool, **kwargs):
    """SGLang's ``schedule_batch.release_req``, keeping the request's fed routes first."""
    keep_fed_routes(req, req_to_token_pool)
    return _original_release(req=req, req_to_token_pool=req_to_token_pool, **kwargs)


def collect_routed_experts(processor, req) -> None:
    """SGLang's ``_maybe_collect_routed_experts``, with the rows kept at retractions put back."""
    _original_collect(processor, req)
    kept = getattr(req, FED_ROUTES, None)
    if kept is not None and getattr(req, "routed_experts", None) is not None:
        overlay_kept_routes(req.routed_experts, kept, req.routed_experts_start_len)


def install() -> None:
    """Route SGLang's request release and route collection in this process through
    :func:`release_req` and :func:`collect_routed_experts` (idempotent)."""
    global _original_release, _original_collect
    from sglang.srt.managers import schedule_batch
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    if schedule_batch.release_req is release_req:
        return
    _original_release = schedule_batch.release_req
    _original_collect = SchedulerBatchResultProcessor._maybe_collect_routed_experts
    schedule_batch.release_req = release_req  # retract_all and ScheduleBatch.release_req call the global
    SchedulerBatchResultProcessor._maybe_collect_routed_experts = collect_routed_experts
