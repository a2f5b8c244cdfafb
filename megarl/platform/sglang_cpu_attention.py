"""Batched attention for SGLang's torch-native backend (its only attention backend on megarl's CPU path).

SGLang 0.5.23's ``TorchNativeAttnBackend`` runs one ``scaled_dot_product_attention`` call per request
and layer, in a Python loop (its own comment: "this loop process a sequence per iter, this is
inefficient"), so a batch of 512 short requests costs 512 calls of a few tensor ops each per layer, and
on the tiny demo model that loop, not the arithmetic, is most of the rollout. The functions here
compute the same attention for the whole batch in one call: every request's keys and values are
gathered from the KV cache into a [B, heads, L, head_dim] block padded to the longest request, and a
boolean mask keeps each query to its own request's positions (and, in extend, to the causal
prefix). Padding is never attended, so each request's output is the loop's up to float rounding.

What the batched form does not cover (encoder / cross attention, sliding windows) goes to SGLang's
loop unchanged. Batches are split so no gathered block exceeds :data:`MAX_GATHER_ELEMENTS`.
"""
from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

MAX_GATHER_ELEMENTS = 1 << 24  # per chunk of requests: key block elements + mask elements (64 MiB of fp32)


def _chunks(batch: int, per_request: int) -> list[slice]:
    size = max(1, MAX_GATHER_ELEMENTS // max(1, per_request))
    return [slice(i, min(batch, i + size)) for i in range(0, batch, size)]


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, dtype: torch.dtype):
    """Keys and values [B, kv_heads, L, head_dim] of each request's first ``seq_lens`` cache slots (L = the
    longest; slots past a request's length read slot 0) and ``valid`` bool [B, L]."""
    length = int(seq_lens.max())
    valid = torch.arange(length, device=seq_lens.device)[None, :] < seq_lens[:, None]
    slots = torch.where(valid, req_to_token[req_pool_indices, :length], 0)
    keys = k_cache[slots].permute(0, 2, 1, 3).to(dtype)
    values = v_cache[slots].permute(0, 2, 1, 3).to(dtype)
    return keys, values, valid


def decode(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scaling=None,
           enable_gqa: bool = False) -> torch.Tensor:
    """One new token per request. ``query``/``output`` [B, heads, head_dim]; ``k_cache``/``v_cache``
    [slots, kv_heads, head_dim]; ``req_to_token`` [max_reqs, max_context] (int cache slots);
    ``req_pool_indices``/``seq_lens`` [B] (the lengths include the new token). Writes and returns ``output``."""
    batch = seq_lens.shape[0]
    if batch == 0:
        return output
    length = int(seq_lens.max())
    for part in _chunks(batch, length * (k_cache.shape[1] * k_cache.shape[2] + 1)):
        keys, values, valid = _gather_kv(k_cache, v_cache, req_to_token, req_pool_indices[part], seq_lens[part],
                                         query.dtype)
        out = scaled_dot_product_attention(query[part].unsqueeze(2), keys, values, attn_mask=valid[:, None, None, :],
                                           enable_gqa=enable_gqa, scale=scaling)
        output[part] = out.squeeze(2)
    return output


def extend(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
           extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, scaling=None, enable_gqa: bool = False,
           causal: bool = True) -> torch.Tensor:
    """``extend_seq_lens[b]`` new tokens per request after a cached prefix of ``extend_prefix_lens[b]``
    (``seq_lens`` = prefix + new). ``query``/``output`` [sum(extend_seq_lens), heads, head_dim], the
    requests' tokens one after another; the rest as :func:`decode`. Writes and returns ``output``."""
    batch = seq_lens.shape[0]
    if batch == 0:
        return output
    starts = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens
    q_len, kv_len = int(extend_seq_lens.max()), int(seq_lens.max())
    per_request = kv_len * (k_cache.shape[1] * k_cache.shape[2] + q_len) + q_len * query.shape[1] * query.shape[2]
    for part in _chunks(batch, per_request):
        new, prefix = extend_seq_lens[part], extend_prefix_lens[part]
        if int(new.max()) == 0:
            continue
        q_pos = torch.arange(int(new.max()), device=query.device)
        q_valid = q_pos[None, :] < new[:, None]  # [b, Lq]
        rows = torch.where(q_valid, starts[part][:, None] + q_pos[None, :], 0)
        keys, values, kv_valid = _gather_kv(k_cache, v_cache, req_to_token, req_pool_indices[part], seq_lens[part],
                                            query.dtype)
        mask = kv_valid[:, None, :].expand(-1, q_pos.shape[0], -1)  # [b, Lq, Lk]
        if causal:
            k_pos = torch.arange(keys.shape[2], device=query.device)
            mask = mask & (k_pos[None, None, :] <= (prefix[:, None] + q_pos[None, :])[:, :, None])
        mask = mask | ~q_valid[:, :, None]  # padded query rows attend to everything (and are dropped), never NaN
        out = scaled_dot_product_attention(query[rows].permute(0, 2, 1, 3), keys, values, attn_mask=mask[:, None],
                                           enable_gqa=enable_gqa, scale=scaling)
        output[rows[q_valid]] = out.permute(0, 2, 1, 3)[q_valid]
    return output


def _loop_only(encoder_lens, is_cross_attn: bool, sliding_window_size) -> bool:
    """What the batched form does not cover: encoder / cross attention and sliding windows."""
    return encoder_lens is not None or is_cross_attn or (sliding_window_size is not None and sliding_window_size > -1)


def install() -> None:
    """Make ``TorchNativeAttnBackend`` use :func:`extend` and :func:`decode` where they apply."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    loop_extend = TorchNativeAttnBackend._run_sdpa_forward_extend
    loop_decode = TorchNativeAttnBackend._run_sdpa_forward_decode
    if getattr(loop_decode, "_megarl_cpu", False):
        return

    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None,
                                 enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None):
        if _loop_only(encoder_lens, is_cross_attn, sliding_window_size):
            return loop_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                               extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                               is_cross_attn, sliding_window_size)
        return extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                      extend_seq_lens, scaling, enable_gqa, causal)

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                                 sliding_window_size=None):
        if _loop_only(encoder_lens, is_cross_attn, sliding_window_size):
            return loop_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                               encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)
        return decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scaling, enable_gqa)

    _run_sdpa_forward_decode._megarl_cpu = True
    _run_sdpa_forward_extend.loop, _run_sdpa_forward_decode.loop = loop_extend, loop_decode  # SGLang's, for tests
    TorchNativeAttnBackend._run_sdpa_forward_extend = _run_sdpa_forward_extend
    TorchNativeAttnBackend._run_sdpa_forward_decode = _run_sdpa_forward_decode
