"""Packed (THD) sequences through megatron's local attention.

megatron's local ``DotProductAttention`` refuses packed batches on every device ("Packed sequence is
not supported by DotProductAttention"); only transformer-engine's attention takes them. With local
layers (CPU, or CUDA without TE) a THD call is answered by :func:`varlen_causal_attention`, causal
attention restricted to each sequence of ``cu_seqlens_q``; every other call goes to megatron's own
forward. :func:`enable` installs that once per process.
"""
from __future__ import annotations

import torch

_megatron_forward = None  # DotProductAttention.forward as megatron wrote it, once enable() ran


def varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention within each packed sequence. query [t, np, hn], key/value [t, ng, hn] (GQA:
    ng divides np), cu_seqlens int [n + 1] with ``cu_seqlens[-1] == t``, all on one device; returns
    [t, np * hn]. Sequences of equal length run as one batch of torch SDPA, so memory and work grow
    with the sum of squared sequence lengths, as in a varlen kernel, not with the square of the pack."""
    t, heads, dim = query.shape
    if int(cu_seqlens[-1]) != t:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, the packed batch has {t} tokens")
    if key.shape[1] != heads:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    out = query.new_empty(t, heads, dim)
    for length in lengths.unique().tolist():
        if length == 0:
            continue
        positions = starts[lengths == length][:, None] + torch.arange(length, device=query.device)  # [n, length]
        q, k, v = (x[positions].permute(0, 2, 1, 3) for x in (query, key, value))  # [n, heads, length, dim]
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                                    scale=scale)
        out = out.index_put((positions,), attended.permute(0, 2, 1, 3))
    return out.reshape(t, heads * dim)


def megatron_forward():
    """megatron's own ``DotProductAttention.forward`` (before or after :func:`enable`)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return _megatron_forward or DotProductAttention.forward


def enable() -> None:
    """Route THD calls of megatron's local attention to :func:`varlen_causal_attention` (idempotent)."""
    global _megatron_forward
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if _megatron_forward is not None:
        return
    original = _megatron_forward = DotProductAttention.forward

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                            packed_seq_params)
        return varlen_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q, self.softmax_scale,
                                       self.attention_dropout.p if self.training else 0.0)

    DotProductAttention.forward = forward
