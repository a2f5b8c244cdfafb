"""The planner: recipes compose and fit, parameter counts against HF's modeling code and the
published totals, refusals of layouts that do not fit, and the memory arithmetic's invariants."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.config import ConfigError, load_config, recipes_dir
from megarl.config.errors import PlacementError
from megarl.models.tiny_moe import make_tiny_moe
from megarl.parallel import PipelineSplitError, stage_layers
from megarl.plan import EXIT_DOES_NOT_FIT, main
from megarl.planner.arch import resolve_arch
from megarl.planner.engine_memory import kv_bytes_per_token
from megarl.planner.layout import broken_limits, plan_layout
from megarl.planner.params import count_params
from megarl.planner.trainer_memory import trainer_memory
from megarl.planner.units import GIB

pytestmark = pytest.mark.unit

BIG_RECIPES = ["qwen3_30b_a3b", "qwen3_235b_a22b", "glm45_355b_a32b", "deepseek_v3_671b"]
FULL_SIZE = BIG_RECIPES + ["qwen3_30b_a3b_lora"]  # recipes that state every architecture number


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture(scope="module")
def tool_calling_ckpt(tmp_path_factory) -> Path:
    from megarl.models.tiny_moe import TOOL_CALLING_DEFAULTS, TinyMoeSpec

    return make_tiny_moe(tmp_path_factory.mktemp("tiny_moe_tools"),
                         TinyMoeSpec(tool_calling=True, **TOOL_CALLING_DEFAULTS), max_operand=99)


def _args(recipe: str, tiny_ckpt: Path) -> list[str]:
    """A recipe plus, for the recipes whose numbers come from a checkpoint, the tiny one."""
    args = [f"recipe={recipe}"]
    if recipe not in FULL_SIZE:
        args.append(f"model.hf_path={tiny_ckpt}")
    return args


@pytest.mark.parametrize("recipe", sorted(p.stem for p in recipes_dir().glob("*.yaml")))
def test_every_recipe_composes_and_fits(recipe, request, tmp_path, capsys):
    tiny_ckpt = request.getfixturevalue("tool_calling_ckpt" if recipe == "tiny_moe_tool_calling" else "tiny_ckpt")
    out = tmp_path / "plan.json"
    assert main(_args(recipe, tiny_ckpt) + ["--json", str(out)]) == 0, capsys.readouterr().err
    written = json.loads(out.read_text())
    plan = plan_layout(load_config(_args(recipe, tiny_ckpt)))
    assert written["fits"] and written["broken_limits"] == []
    assert written["params"]["total"] == plan.params.total
    assert [s["total"] for s in written["trainer"]] == [s.total for s in plan.trainer]
    assert "trainer: per-GPU memory" in capsys.readouterr().out


def test_big_recipes_cover_the_parallel_knobs():
    """Between them the big recipes exercise every parallel dimension the issue names."""
    cfgs = [load_config([f"recipe={r}"]) for r in BIG_RECIPES]
    assert any(c.parallel.pp > 1 for c in cfgs) and any(c.parallel.vpp for c in cfgs)
    assert any(c.parallel.cp > 1 for c in cfgs) and any(c.rollout.engine_dp_attention for c in cfgs)
    assert {c.placement.value for c in cfgs} == {"colocated", "disaggregated"}
    assert all(c.parallel.ep > 1 and c.parallel.sequence_parallel for c in cfgs)


def _hf_config(arch):
    """The HF transformers config of the same architecture (the independent count)."""
    from transformers import DeepseekV3Config, Glm4MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.ffn_hidden_size,
                  moe_intermediate_size=arch.moe_ffn_hidden_size, num_hidden_layers=arch.num_layers,
                  num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_query_groups,
                  num_experts_per_tok=arch.moe_topk, tie_word_embeddings=arch.tie_word_embeddings)
    if arch.family == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=arch.head_dim, num_experts=arch.num_experts)
    moe = dict(n_routed_experts=arch.num_experts, n_shared_experts=arch.num_shared_experts,
               first_k_dense_replace=arch.first_k_dense_layers)
    if arch.family == "glm4_moe":
        return Glm4MoeConfig(**common, **moe, head_dim=arch.head_dim, use_qk_norm=arch.qk_layernorm,
                             attention_bias=arch.attention_bias)
    return DeepseekV3Config(**common, **moe, q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
                            qk_nope_head_dim=arch.qk_nope_head_dim, qk_rope_head_dim=arch.qk_rope_head_dim,
                            v_head_dim=arch.v_head_dim)


@pytest.mark.parametrize("recipe", BIG_RECIPES)
def test_param_count_equals_hf_modeling_code(recipe):
    """Build the full-size HF model on the meta device and count its checkpoint tensors (HF builds
    no MTP module, so this is the main model; the sigmoid routers' correction bias is a buffer in
    the state dict)."""
    from transformers import AutoModelForCausalLM

    arch = resolve_arch(load_config([f"recipe={recipe}"]))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(arch))
    state = model.state_dict()
    assert count_params(arch).total == sum(t.numel() for t in state.values())
    routed = sum(t.numel() for name, t in state.items() if ".mlp.experts." in name)
    assert count_params(arch).routed_experts == routed


B = 1e9
# (recipe, what is published, the published number, our number under the publisher's convention)
# Sources: the model cards of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (total, activated, and
# non-embedding totals), zai-org/GLM-4.5 (355B total / 32B active), deepseek-ai/DeepSeek-V3's
# README_WEIGHTS.md (671B main model; 36.6B activated including the 0.9B head; MTP 11.5B unique;
# the HF checkpoint's 685B = main model + MTP with its own copies of embedding and head).
PUBLISHED = [
    ("qwen3_30b_a3b", "total", 30.5 * B, lambda c: c.total),
    ("qwen3_30b_a3b", "non-embedding total", 29.9 * B, lambda c: c.total - c.embedding - c.head),
    ("qwen3_235b_a22b", "total", 235 * B, lambda c: c.total),
    ("qwen3_235b_a22b", "non-embedding total", 234 * B, lambda c: c.total - c.embedding - c.head),
    ("qwen3_235b_a22b", "active (with embedding and head)", 22 * B, lambda c: c.active),
    ("glm45_355b_a32b", "total (MTP layer excluded)", 355 * B, lambda c: c.total),
    ("glm45_355b_a32b", "active (without embedding and head)", 32 * B, lambda c: c.active - c.embedding - c.head),
    ("deepseek_v3_671b", "total (MTP excluded)", 671 * B, lambda c: c.total),
    ("deepseek_v3_671b", "active (with head, without embedding)", 36.6 * B, lambda c: c.active - c.embedding),
    ("deepseek_v3_671b", "MTP module (unique)", 11.5 * B, lambda c: c.mtp),
    ("deepseek_v3_671b", "HF checkpoint (with MTP)", 685 * B, lambda c: c.total + c.mtp + c.embedding + c.head),
]


@pytest.mark.parametrize("recipe,what,published,ours", PUBLISHED, ids=[f"{r}:{w}" for r, w, _, _ in PUBLISHED])
def test_param_counts_match_published_within_one_percent(recipe, what, published, ours):
    counts = count_params(resolve_arch(load_config([f"recipe={recipe}"])))
    assert abs(ours(counts) / published - 1) < 0.01, f"{recipe} {what}: {ours(counts) / B:.3f}B vs {published / B}B"


def test_qwen3_30b_active_matches_the_published_digits():
    """Qwen prints 3.3B activated: 3.353B cut to one decimal (1.6% above the printed figure, so the
    1% rule cannot apply to a number printed with two digits; the digits must agree)."""
    counts = count_params(resolve_arch(load_config(["recipe=qwen3_30b_a3b"])))
    assert int(counts.active / 1e8) == 33


def test_tiny_counts_equal_the_checkpoint(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt)
    arch = resolve_arch(load_config(["recipe=tiny_moe_cpu", f"model.hf_path={tiny_ckpt}"]))
    counts = count_params(arch)
    hf_total = sum(p.numel() for p in model.parameters())
    hf_experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    cfg = model.config
    idle = hf_experts * (cfg.num_experts - cfg.num_experts_per_tok) // cfg.num_experts
    assert counts.total == hf_total
    assert counts.active == hf_total - idle
    assert counts.embedding == model.get_input_embeddings().weight.numel()


def test_max_total_tokens_caps_the_engines_kv_cache(tiny_ckpt):
    """The CPU recipe's ``rollout.max_total_tokens`` (SGLang's --max-total-tokens) is its engine's KV cache;
    without it the cache is what the memory fraction leaves."""
    capped = plan_layout(load_config(["recipe=tiny_moe_cpu", f"model.hf_path={tiny_ckpt}"])).engine
    sized = plan_layout(load_config(["recipe=tiny_moe_cpu", f"model.hf_path={tiny_ckpt}",
                                     "rollout.max_total_tokens=null"])).engine
    assert capped.kv_tokens_per_engine == 65536 and capped.kv_cache == 65536 * capped.kv_bytes_per_token
    assert sized.kv_cache == sized.pool - sized.weights and sized.kv_tokens_per_engine > 65536


def test_too_small_gpu_is_refused_with_the_limit_named(capsys):
    args = ["recipe=qwen3_30b_a3b", "trainer.gpu_memory_gb=1"]
    assert main(args) == EXIT_DOES_NOT_FIT
    err = capsys.readouterr().err
    peak = max(s.total for s in plan_layout(load_config(args)).trainer) / GIB
    assert f"trainer.gpu_memory_gb: a trainer GPU of pipeline stage 0 needs {peak:.1f} GB" in err
    assert f"over the 1 GB limit by {peak - 1:.1f} GB" in err
    assert "rollout.mem_fraction_static: engine weights take" in err


def test_kv_cache_too_small_for_one_sequence_is_refused():
    cfg = load_config(["recipe=qwen3_235b_a22b", "rollout.kv_cache_gb=0.5", "rollout.max_new_tokens=32768"])
    broken = broken_limits(plan_layout(cfg), cfg)
    assert len(broken) == 1 and broken[0].startswith("rollout.max_new_tokens: the engine KV cache holds")


def test_colocated_engines_beyond_the_trainer_gpus_are_refused():
    with pytest.raises(PlacementError, match="rollout.num_engines: colocated engines need 16 devices"):
        load_config(["recipe=qwen3_30b_a3b", "rollout.num_engines=8"])


def test_missing_architecture_is_an_error_naming_the_key(tmp_path, capsys):
    assert main(["recipe=tiny_moe_cpu", f"model.hf_path={tmp_path / 'absent'}", "model.arch.num_layers=null"]) == 1
    assert "model.arch.num_layers: not set in the recipe and not found" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="model.dtype"):
        plan_layout(load_config(["recipe=qwen3_30b_a3b", "model.dtype=int8"]))


def test_kv_bytes_per_token_against_published():
    """DeepSeek-V3's MLA cache is 70.272 KB a token in bf16 (DeepSeek's "Insights into DeepSeek-V3",
    table 1); Qwen3-235B's GQA cache is 2 x 94 layers x 4 heads x 128 x 2 bytes when unsharded."""
    ds = resolve_arch(load_config(["recipe=deepseek_v3_671b"]))
    assert kv_bytes_per_token(ds, attention_tp=1, size=2) == 70_272
    assert kv_bytes_per_token(ds, attention_tp=8, size=2) == 70_272  # the latent is not split over TP
    qwen = resolve_arch(load_config(["recipe=qwen3_235b_a22b"]))
    assert kv_bytes_per_token(qwen, attention_tp=1, size=2) == 2 * 94 * 4 * 128 * 2
    assert kv_bytes_per_token(qwen, attention_tp=16, size=2) == 2 * 94 * 1 * 128 * 2  # replicated past 4


def test_interleaved_stages_take_megatron_order_and_cover_every_layer():
    assert stage_layers(8, pp=2, vpp=2, stage=0) == [0, 1, 4, 5]
    assert stage_layers(8, pp=2, vpp=2, stage=1) == [2, 3, 6, 7]
    assert sorted(stage_layers(92, 2, 2, 0) + stage_layers(92, 2, 2, 1)) == list(range(92))


# (num_layers, pp, vpp, first_stage_layers, last_stage_layers); the last two megatron refuses
SPLITS = [(12, 3, 2, 2, 2), (10, 3, None, 2, 4), (94, 4, None, 22, 24), (9, 2, None, None, 4), (8, 2, 2, None, None),
          (61, 4, None, 16, 15), (16, 4, 2, 2, None), (10, 2, 2, 3, None)]


@pytest.mark.parametrize("layers,pp,vpp,first,last", SPLITS)
def test_stage_layers_equal_megatron_core_split(layers, pp, vpp, first, last):
    """Layer indices per stage (and virtual chunk) as megatron-core builds them, or the same refusal."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megarl.platform import megatron_cpu

    megatron_cpu.apply()
    try:
        config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=1,
                                   pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                   num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                   pipeline_dtype=torch.float32)
    except ValueError:
        with pytest.raises(PipelineSplitError):
            stage_layers(layers, pp, vpp or 1, 0, first, last)
        return
    for stage in range(pp):
        theirs = []
        for chunk in range(vpp or 1):
            vp = chunk if vpp else None
            offset = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=stage)
            theirs += range(offset, offset + get_num_layers_to_build(config, vp_stage=vp, pp_rank=stage))
        assert stage_layers(layers, pp, vpp or 1, stage, first, last) == theirs


def test_uneven_stages_are_planned_and_validated():
    """Qwen3-235B's 94 layers on PP4: refused evenly (naming the fix), planned with 22 / 24 / 24 / 24."""
    base = ["recipe=qwen3_235b_a22b", "parallel.pp=4", "parallel.world_size=256"]
    with pytest.raises(ConfigError, match="parallel.pp: 94 layers do not split into pp.vpp = 4 stages "
                                          ".set parallel.first_stage_layers"):
        load_config(base)
    with pytest.raises(ConfigError, match="parallel.first_stage_layers: 94 layers leave"):
        load_config(base + ["parallel.first_stage_layers=50", "parallel.last_stage_layers=50"])
    cfg = load_config(base + ["parallel.first_stage_layers=22"])
    arch = resolve_arch(cfg)
    stages = trainer_memory(arch, cfg)
    assert [s.layers for s in stages] == [22, 24, 24, 24]
    assert stages[0].params < stages[1].params  # two layers fewer outweigh the embedding


# Trainer layouts smaller than the recipe's engines: planned with the engines on devices of their own.
APART = ["placement=disaggregated", "sync.transport=distributed"]


def test_unsharded_layout_holds_the_whole_model_and_stages_partition_it():
    """pp=1, tp=1, ep=1: one GPU holds every parameter; with pp=2 the stages hold them between them."""
    one = load_config(["recipe=glm45_355b_a32b", "parallel.world_size=1", "parallel.tp=1", "parallel.pp=1",
                       "parallel.vpp=null", "parallel.ep=1", "parallel.etp=1", "parallel.sequence_parallel=false",
                       *APART])
    total = count_params(resolve_arch(one)).total
    assert trainer_memory(resolve_arch(one), one)[0].params == total
    two = load_config(["recipe=glm45_355b_a32b", "parallel.world_size=2", "parallel.tp=1", "parallel.pp=2",
                       "parallel.vpp=2", "parallel.ep=1", "parallel.etp=1", "parallel.sequence_parallel=false", *APART])
    assert abs(sum(s.params for s in trainer_memory(resolve_arch(two), two)) - total) <= 2  # per-stage rounding


def test_distributed_optimizer_shards_adam_state_over_data_parallel_ranks():
    """bf16 weights: 12 bytes of Adam state (fp32 master, two moments) a parameter, split over DP."""
    base = ["recipe=qwen3_30b_a3b", "parallel.tp=1", "parallel.ep=1", "parallel.sequence_parallel=false",
            "trainer.optimizer_cpu_offload=false", *APART]
    one = load_config(base + ["parallel.world_size=1"])
    four = load_config(base + ["parallel.world_size=4"])
    s1, s4 = trainer_memory(resolve_arch(one), one)[0], trainer_memory(resolve_arch(four), four)[0]
    assert s1.optimizer == 12 * s1.params
    assert abs(s4.optimizer - s1.optimizer / 4) <= 1
    offload = load_config(base + ["parallel.world_size=1", "trainer.optimizer_cpu_offload=true"])
    s_off = trainer_memory(resolve_arch(offload), offload)[0]
    assert s_off.optimizer == 0 and s_off.host_optimizer == s1.optimizer


def test_recompute_orders_activation_memory():
    acts = {}
    for mode in ("none", "selective", "full"):
        cfg = load_config(["recipe=qwen3_235b_a22b", f"trainer.recompute={mode}"])
        acts[mode] = trainer_memory(resolve_arch(cfg), cfg)[0].activations
    assert acts["full"] < acts["selective"] < acts["none"]


def test_weight_sync_time_is_bytes_over_the_link():
    cfg = load_config(["recipe=qwen3_235b_a22b"])
    plan = plan_layout(cfg)
    assert plan.sync.bytes_per_sync == 2 * plan.params.total
    assert plan.sync.seconds == pytest.approx(plan.sync.bytes_per_sync * 8 / (cfg.sync.link_gbps * 1e9))
    assert plan.sync.buckets * cfg.sync.bucket_mb * 2**20 >= plan.sync.bytes_per_sync


def _qwen3_32b_config():
    """Qwen/Qwen3-32B's config.json numbers (a dense model: the judge below)."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)


def test_auxiliary_engines_memory_is_planned_from_their_checkpoints(tmp_path, capsys):
    """A Qwen3-235B-A22B teacher and a dense Qwen3-32B judge beside the 30B policy: each engine GPU's
    weights are its model's bytes over its ranks (the counts against HF's modeling code and the
    published totals), its KV cache what the pool leaves; too few ranks is a broken limit naming the
    key; a checkpoint that is not here is reported, not planned."""
    from transformers import AutoModelForCausalLM

    from megarl.planner.arch import served_arch

    teacher, judge = tmp_path / "teacher", tmp_path / "judge"
    _hf_config(resolve_arch(load_config(["recipe=qwen3_235b_a22b"]))).save_pretrained(teacher)
    _qwen3_32b_config().save_pretrained(judge)
    dense = served_arch(str(judge), "reward.judge.hf_path")
    with torch.device("meta"):
        hf_judge = AutoModelForCausalLM.from_config(_qwen3_32b_config())
    assert count_params(dense).total == sum(t.numel() for t in hf_judge.state_dict().values())
    assert abs(count_params(dense).total / 32.8e9 - 1) < 0.01  # the model card's 32.8B
    moe = count_params(served_arch(str(teacher), "teacher.hf_path")).total
    assert abs(moe / 235e9 - 1) < 0.01

    args = ["recipe=qwen3_30b_a3b", f"teacher.hf_path={teacher}", "algorithm.opd_coef=1.0", "teacher.engine_tp=8",
            f"reward.judge.hf_path={judge}", "reward.judge.engine_tp=4"]
    cfg = load_config(args)
    plan = plan_layout(cfg)
    size = 2  # the recipe's bfloat16
    assert cfg.model.dtype == "bfloat16"
    (t, j) = plan.auxiliary
    assert (t.name, t.key, t.devices, j.name, j.key, j.devices) == ("teacher", "teacher", 8, "judge", "reward.judge", 4)
    for a, params in ((t, moe), (j, count_params(dense).total)):
        e = a.memory
        assert abs(e.weights / (params * size / a.devices) - 1) < 0.01, a.name  # norms, router, KV heads replicated
        assert e.pool == round(cfg.rollout.mem_fraction_static * cfg.trainer.gpu_memory_gb * GIB)
        assert e.kv_cache == e.pool - e.weights and e.kv_tokens_per_engine == e.kv_cache // e.kv_bytes_per_token
    assert j.memory.kv_bytes_per_token == 2 * 64 * (8 // 4) * 128 * size  # K and V, 64 layers, 2 KV heads a GPU
    assert t.memory.kv_bytes_per_token == 2 * 94 * 1 * 128 * size  # 4 KV heads over 8 ranks: one each
    assert broken_limits(plan, cfg) == []
    assert cfg.placement == "colocated" and plan.total_gpus == 8 + 8 + 4  # the policy engines on the trainer's 8
    out = tmp_path / "plan.json"
    assert main(args + ["--json", str(out)]) == 0
    written = json.loads(out.read_text())["auxiliary"]
    assert [(a["name"], a["memory"]["weights"]) for a in written] == [("teacher", t.memory.weights),
                                                                      ("judge", j.memory.weights)]
    assert "auxiliary engines: per-GPU memory" in capsys.readouterr().out

    few = load_config(args + ["teacher.engine_tp=4"])
    [line] = broken_limits(plan_layout(few), few)
    assert line.startswith("teacher.engine_tp: teacher engine weights take 109.") and "on 4 ranks" in line, line
    assert main(args + ["teacher.engine_tp=4"]) == EXIT_DOES_NOT_FIT
    assert "plan: does not fit: teacher.engine_tp: teacher engine weights take" in capsys.readouterr().err

    absent = load_config(args + [f"teacher.hf_path={tmp_path / 'elsewhere'}"])
    plan = plan_layout(absent)
    assert plan.auxiliary[0].memory is None and str(tmp_path / "elsewhere") in plan.auxiliary[0].why
    assert broken_limits(plan, absent) == []
    with pytest.raises(PlacementError, match=r"^reward.judge.engine_ep: 2 expert-parallel ranks for a dense model"):
        load_config(args + ["reward.judge.engine_ep=2"])
