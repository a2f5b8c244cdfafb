"""How an SGLang engine splits its weights over its ranks, read from the engine's resolved server arguments
(``/server_info``), as the sharded slice map (:mod:`megarl.sync.slices`) needs it.

SGLang 0.5.23's rules (``sglang.srt.runtime_context``: ``derive_parallel_widths``, ``derive_attention_ranks``,
``derive_spawn_ranks``), for engine rank ``r`` of ``tp_size`` ranks:

- attention (``QKVParallelLinear`` / ``RowParallelLinear`` with ``parallel_group="attn_tp"``, every
  ``self_attn`` projection, MLA's included) and the input embedding (``VocabParallelEmbedding`` with
  ``use_attn_tp_group`` under DP attention) are split over the attention-TP group: ``attn_tp_size =
  tp_size // attn_dp_size // attn_cp_size`` ranks, rank ``r % attn_tp_size``; with DP attention over every
  rank (``attn_dp_size == tp_size``) that is one rank, i.e. each rank loads them whole;
- the LM head (``ParallelLMHead(use_attn_tp_group=enable_dp_lm_head)``) over the attention-TP group with
  ``enable_dp_lm_head``, else over all ``tp_size`` ranks;
- routed experts (``FusedMoE``) over ``ep_size`` EP ranks in contiguous runs, each expert over
  ``moe_tp_size = tp_size // moe_dp_size // ep_size`` ranks: EP rank ``r % (tp_size // moe_dp_size) //
  moe_tp_size``, MoE-TP rank ``r % moe_tp_size``;
- every other split weight (dense MLPs, shared experts) over all ``tp_size`` ranks.

Settings that place weights another way are refused (:func:`layout_from_server_info` names the key):
redundant experts and EPLB (``logical_to_all_physical`` gives an expert several physical slots), elastic
EP, paged experts, an expert all-to-all backend (shared experts then replicated), attention context
parallelism, DP replicas or pipeline stages in one server, and the dense/shared-expert TP overrides.
"""
from __future__ import annotations

from dataclasses import dataclass

# /server_info key -> the value the slice map assumes (a key the server does not report is at its default)
ASSUMED = {
    "pp_size": 1, "dp_size": 1, "attn_cp_size": 1, "dcp_size": 1, "dwdp_size": 1,
    "ep_num_redundant_experts": 0, "enable_eplb": False, "init_expert_location": "trivial",
    "elastic_ep_backend": None, "max_ep_size": None, "ep_join_rank_offset": 0, "enable_elastic_expert_backup": False,
    "enable_paged_experts": False, "moe_a2a_backend": "none", "enable_shared_experts_attn_tp": False,
    "shared_experts_tp_size": None, "enable_dense_mlp_attn_tp": False, "quantization": None,
}


@dataclass(frozen=True)
class EngineLayout:
    """One engine's weight layout: ``tp`` ranks; attention and the input embedding over ``attn_tp`` of
    them; routed experts over ``ep`` EP ranks in each of ``moe_dp`` MoE data-parallel groups; the LM head
    over the attention-TP group when ``dp_lm_head``, else over all ``tp``."""

    tp: int
    attn_tp: int
    ep: int = 1
    moe_dp: int = 1
    dp_lm_head: bool = False

    def __post_init__(self):
        if self.tp % self.attn_tp or self.tp % (self.moe_dp * self.ep):
            raise ValueError(f"engine layout {self}: attention-TP and moe_dp x ep must divide tp")

    @classmethod
    def tensor_parallel(cls, tp: int, ep: int = 1) -> EngineLayout:
        """An engine without DP attention: attention and the embedding over all ``tp`` ranks."""
        return cls(tp=tp, attn_tp=tp, ep=ep)

    @property
    def moe_tp(self) -> int:
        return self.tp // self.moe_dp // self.ep


def layout_from_server_info(info: dict) -> EngineLayout:
    """The layout of the engine whose resolved server arguments are ``info`` (``/server_info``); ValueError
    naming the first setting the slice map does not handle."""
    for key, assumed in ASSUMED.items():
        if info.get(key, assumed) != assumed:
            raise ValueError(f"the engine runs with {key}={info[key]!r}, which places weights in a way sharded "
                             f"resharding does not map (it assumes {key}={assumed!r}); use sync.transport=distributed")
    tp = int(info["tp_size"])
    dense = info.get("moe_dense_tp_size")
    if dense not in (None, tp):
        raise ValueError(f"the engine runs with moe_dense_tp_size={dense}, which sharded resharding does not map (it "
                         f"splits dense MLPs over tp_size={tp}); use sync.transport=distributed")
    attn_dp = int(info.get("attn_dp_size") or 1)
    return EngineLayout(tp=tp, attn_tp=tp // attn_dp // int(info.get("attn_cp_size") or 1),
                        ep=int(info.get("ep_size") or 1), moe_dp=int(info.get("moe_dp_size") or 1),
                        dp_lm_head=bool(info.get("enable_dp_lm_head")))
