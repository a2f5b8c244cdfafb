"""The typed Hydra schema of a megarl run.

Every recipe in ``recipes/`` composes onto :class:`MegarlConfig`; Hydra rejects unknown keys and
wrong types. Each field declares its range or its names once (:func:`megarl.fields.setting`), checked
for every section by :func:`megarl.fields.out_of_bounds`; :mod:`megarl.config.validate` rejects
impossible combinations (layouts that do not divide, MoE with TP>1 and no sequence parallel, ...). A
component that owns its section declares it beside its code (``lora``: :class:`megarl.models.lora.LoraConfig`,
``sync``: :class:`megarl.sync.settings.SyncConfig`) and the schema nests it. Units are in the field names
or comments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import II, MISSING

from megarl.algos.advantages import ADVANTAGES, TOKEN_LEVEL
from megarl.algos.aggregation import AGGREGATIONS
from megarl.algos.distill import OPD_BASELINES
from megarl.algos.gae import CRITIC_ADVANTAGES
from megarl.algos.kl import KL_ESTIMATORS
from megarl.algos.kl_control import KL_CONTROLLERS
from megarl.algos.off_policy import CORRECTIONS, LEVELS, OLD_POLICIES
from megarl.algos.policy_loss import DPPO_TYPES, POLICY_LOSSES
from megarl.algos.score_centering import SCORE_CENTERING
from megarl.fields import setting
from megarl.metrics.trackers import MlflowConfig, WandbConfig
from megarl.models.lora import LoraConfig
from megarl.rollout.env import ENVIRONMENTS
from megarl.rollout.group import PARTIAL_ROLLOUT_MODES
from megarl.sync.settings import SyncConfig
from megarl.tasks.prompts import TASKS
from megarl.tasks.rewards import REWARD_TYPES

DTYPES = ("float32", "bfloat16", "float16")  # model.dtype
LR_DECAY_STYLES = ("constant", "linear", "cosine")  # trainer.lr_decay_style (megatron-core's schedules)
ARCH_FAMILIES = ("qwen3_moe", "deepseek_v3", "glm4_moe")  # model.arch.family: the planner's architectures

# What ``python -m megarl.train`` runs (a string: ``async`` cannot name an Enum member):
#   warmup        supervised warm-up only (saves the HF checkpoint RL starts from)
#   sync          RL, buffer depth one batch, sync after every step
#   one_step_off  RL, generation runs one step ahead of training
#   async         RL, two free-running loops joined by the buffer
MODES = ("warmup", "sync", "one_step_off", "async")


class Placement(str, Enum):
    colocated = "colocated"  # trainer and engines share devices; engines release memory while training
    disaggregated = "disaggregated"  # separate device pools


class Dispatcher(str, Enum):
    alltoall = "alltoall"
    allgather = "allgather"


class TransformerImpl(str, Enum):
    auto = "auto"  # transformer_engine when CUDA and TE are present, else local (pure torch)
    local = "local"
    transformer_engine = "transformer_engine"


class TinyVariant(str, Enum):
    arithmetic = "arithmetic"  # the demo's: 64 positions, a tokenizer of sums
    tool_calling = "tool_calling"  # 256 positions, a tokenizer and chat template for OpenAI function calling


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


@dataclass
class ArchConfig:
    """Architecture numbers; for a recipe whose checkpoint is present they are read from it.

    Used by the planner for models too large to load here. ``None`` means "take it from the
    checkpoint's config.json".
    """

    family: str = setting("qwen3_moe", choices=ARCH_FAMILIES)  # qwen3_moe | deepseek_v3 | glm4_moe
    num_layers: Optional[int] = setting(None, ge=1)
    hidden_size: Optional[int] = setting(None, ge=1)
    num_attention_heads: Optional[int] = setting(None, ge=1)
    num_query_groups: Optional[int] = setting(None, ge=1)  # KV heads (GQA)
    head_dim: Optional[int] = setting(None, ge=1)
    ffn_hidden_size: Optional[int] = setting(None, ge=1)  # dense MLP layers
    moe_ffn_hidden_size: Optional[int] = setting(None, ge=1)  # one routed expert
    num_experts: Optional[int] = setting(None, ge=0)
    moe_topk: Optional[int] = setting(None, ge=1)
    num_shared_experts: int = setting(0, ge=0)
    first_k_dense_layers: int = setting(0, ge=0)
    vocab_size: Optional[int] = setting(None, ge=1)
    tie_word_embeddings: bool = False
    # Multi-head latent attention (DeepSeek-V3); 0 = standard attention.
    q_lora_rank: int = setting(0, ge=0)
    kv_lora_rank: int = setting(0, ge=0)
    qk_nope_head_dim: int = setting(0, ge=0)
    qk_rope_head_dim: int = setting(0, ge=0)
    v_head_dim: int = setting(0, ge=0)
    num_mtp_layers: int = setting(0, ge=0)  # multi-token-prediction modules
    qk_layernorm: Optional[bool] = None  # per-head RMSNorm on q and k; None = checkpoint, else family default
    attention_bias: Optional[bool] = None  # bias on the q/k/v projections; None = checkpoint, else family default


@dataclass
class ModelConfig:
    hf_path: str = MISSING  # HF checkpoint directory (config.json + safetensors + tokenizer)
    # build the demo's tiny checkpoint at hf_path when it is absent; a recipe's true holds for its own hf_path only
    # (a model.hf_path given on the command line must exist, unless make_tiny_if_missing=true is given there too)
    make_tiny_if_missing: bool = False
    tiny_variant: TinyVariant = TinyVariant.arithmetic  # which tiny checkpoint (megarl/models/tiny_moe.py)
    dtype: str = setting("float32", choices=DTYPES)  # float32 | bfloat16 | float16: parameter and compute dtype
    transformer_impl: TransformerImpl = TransformerImpl.auto
    # megatron-core's load-balancing loss weight (the checkpoint family's type: aux_loss, seq_aux_loss, ...); under
    # Keep Routing its tokens per expert are the replayed routes' (megarl/models/replayed_balancing.py); 0 = off
    moe_aux_loss_coeff: float = setting(0.0, ge=0)
    # the aux-loss-free expert bias's update per step (megatron's moe_router_bias_update_rate: sign(mean load - load)
    # x rate, from the step's replayed routes), for the families whose routers have the bias (deepseek_v3, glm4_moe:
    # HF e_score_correction_bias, synced into the engines with the weights); None = the family's own (megatron-bridge:
    # 0 for glm4_moe, 1e-3 for deepseek_v3); 0 = frozen
    moe_expert_bias_update_rate: Optional[float] = setting(None, ge=0)
    arch: ArchConfig = field(default_factory=ArchConfig)


@dataclass
class ParallelConfig:
    """Trainer layout. world_size = tp * pp * cp * dp; experts are split over ep * etp ranks."""

    world_size: int = setting(1, ge=1)  # trainer ranks (one per GPU, or one process each on CPU)
    tp: int = setting(1, ge=1)
    pp: int = setting(1, ge=1)
    vpp: Optional[int] = setting(None, ge=1)  # virtual pipeline stages per rank
    # first PP stage's layers (None: even split); middle stages split the rest
    first_stage_layers: Optional[int] = setting(None, ge=0)
    # last PP stage's layers (None: even split), e.g. fewer by the output layer
    last_stage_layers: Optional[int] = setting(None, ge=0)
    cp: int = setting(1, ge=1)
    ep: int = setting(1, ge=1)
    etp: Optional[int] = setting(None, ge=1)  # expert tensor parallel; None = same as tp
    sequence_parallel: bool = False
    dispatcher: Dispatcher = Dispatcher.alltoall
    backend: str = setting("auto", choices=("auto", "gloo", "nccl"))  # auto (nccl on GPU, gloo on CPU) | gloo | nccl


@dataclass
class OptimizerConfig:
    """The optimizer's keys of the ``trainer`` section (``megarl/trainer/optimizer.py`` extends it with what
    a run derives: the decay length and the dtype)."""

    lr: float = setting(1e-3, ge=0)
    min_lr: float = setting(0.0, ge=0)
    lr_warmup_steps: int = setting(0, ge=0)
    lr_decay_style: str = setting("constant", choices=LR_DECAY_STYLES)  # constant | linear | cosine
    weight_decay: float = setting(0.0, ge=0)
    adam_beta1: float = setting(0.9, ge=0, lt=1)
    adam_beta2: float = setting(0.99, ge=0, lt=1)
    adam_eps: float = setting(1e-8, gt=0)
    clip_grad: float = setting(1.0, ge=0)
    use_distributed_optimizer: bool = True
    optimizer_cpu_offload: bool = False  # fp32 master weights and Adam moments in host memory (megatron-core)


@dataclass
class TrainerConfig(OptimizerConfig):
    # optimizer steps per RL step: the batch's prompt groups split into this many mini-batches, one update
    # each (slime's --num-steps-per-rollout; verl's ppo_mini_batch_size = batch / this)
    updates_per_step: int = setting(1, ge=1)
    # token budget of one micro-batch (packed: about this many real tokens)
    max_tokens_per_microbatch: int = setting(4096, ge=1)
    pack_sequences: bool = True  # packed (THD) micro-batches, DP ranks balanced by tokens; false: right-padded rows
    recompute: Recompute = Recompute.none
    recompute_num_layers: Optional[int] = setting(None, ge=1)
    gpu_memory_gb: float = setting(80.0, gt=0)  # per-device memory the planner checks layouts against
    seed: int = setting(1234, ge=0)
    save_interval: int = setting(0, ge=0)  # steps between checkpoints (run_dir/checkpoints); 0 = only at the end
    # continue from run_dir/checkpoints when it holds one (data position and counts too); false: start over, the old
    # run's checkpoints, metrics and event files moved to run_dir/previous/<time>/
    resume: bool = True
    keep_checkpoints: int = setting(3, ge=0)  # the newest checkpoints kept in run_dir/checkpoints; 0 = every one
    # planner: per-device GB for CUDA context, NCCL buffers, fragmentation
    reserved_memory_gb: float = setting(4.0, ge=0)


@dataclass
class CriticConfig(OptimizerConfig):
    """PPO's value model (``algorithm.advantage=gae``, megarl/trainer/critic.py): the policy's architecture with a
    scalar head, on the trainer ranks beside the policy (same layout), with the optimizer keys above of its own
    and a checkpoint beside the policy's in every run checkpoint."""

    enabled: bool = False  # build and train the critic (required by, and only with, algorithm.advantage=gae)
    hf_path: Optional[str] = None  # HF checkpoint of its backbone (the head starts fresh); None = the policy's start
    value_clip: float = setting(0.5, gt=0)  # clip range of the value loss around the values before the step


@dataclass
class WarmupConfig:
    """Supervised warm-up on synthetic arithmetic problems (task.name=arithmetic; the tiny demos'
    starting point). Off by default: RL starts from model.hf_path."""

    steps: int = setting(0, ge=0)  # > 0: RL starts from save_hf_path, made by this many warm-up steps when absent
    batch_size: int = setting(64, ge=1)
    lr: float = setting(1e-3, ge=0)
    log_interval: int = setting(10, ge=1)
    save_hf_path: str = "checkpoints/warmup_hf"  # where the warmed-up HF checkpoint is written
    tool_fraction: float = setting(0.5, ge=0, le=1)  # task.env=calculator: share of warm-up examples that call the tool


@dataclass
class RoleEngines:
    """Where one multi-agent role's calls go (``task.role_engines``): some of the policy's engines, or a
    frozen model of its own."""

    role: str = MISSING  # one of task.roles
    engines: list[int] = field(default_factory=list)  # indices of the policy's engines, < rollout.num_engines
    # a frozen model serves the role instead (an HF checkpoint with the policy's tokenizer), on one
    # engine of its own that is never synced; its calls are not trained on (the agent gives it no reward)
    hf_path: Optional[str] = None
    engine_tp: Optional[int] = setting(None, ge=1)  # that engine's tensor-parallel ranks; None = rollout.engine_tp
    # its expert-parallel ranks (dividing engine_tp); None = rollout.engine_ep
    engine_ep: Optional[int] = setting(None, ge=1)


@dataclass
class TaskConfig:
    name: str = setting("arithmetic", choices=TASKS)  # arithmetic (synthetic, built in) | jsonl | parquet
    path: Optional[str] = None  # dataset file for jsonl / parquet
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # "" = the rows have no answers (e.g. a reward model scores them)
    shuffle: bool = True  # jsonl / parquet: visit the rows in a seeded permutation per epoch
    # jsonl / parquet: render each prompt (a string: one user turn, or a list of chat messages as
    # verl / slime store them) with the tokenizer's chat template and its generation prompt
    chat_template: bool = False
    max_operand: int = setting(9, ge=0)  # arithmetic: operands in [0, max_operand]
    seed: int = setting(0, ge=0)
    # How a prompt becomes a sample: None = one generation (single turn); "calculator" = a multi-turn
    # episode with the calculator tool (megarl/rollout/env.py). ``agent`` ("package.module:function")
    # runs an agent program against megarl's OpenAI-compatible gateway instead (megarl/agents/).
    env: Optional[str] = setting(None, choices=tuple(ENVIRONMENTS))
    agent: Optional[str] = None
    max_turns: int = setting(4, ge=1)  # policy turns per episode (env / agent)
    # episode response budget incl. observations; None = context - prompt
    max_response_tokens: Optional[int] = setting(None, ge=1)
    agent_timeout_s: float = setting(120.0, gt=0)  # an agent episode running longer ends as error (counted)
    # agent worker processes (Ray actors on any node) that run the agent episodes, their tools' work with them,
    # talking to the driver's gateway over the network; 0 = in the driver's event loop (megarl/agents/workers.py)
    agent_workers: int = setting(0, ge=0)
    agent_worker_cpus: float = setting(1.0, ge=0)  # Ray CPUs each agent worker reserves
    agent_worker_episodes: int = setting(16, ge=1)  # episodes one agent worker runs at once (a thread each)
    roles: Optional[list[str]] = None  # multi-agent: the roles an agent names as ``model`` (the policy's unless frozen)
    # multi-agent: the policy engines that serve a role's calls, e.g. [{role: verifier, engines: [1]}],
    # or a frozen model that does ({role: verifier, hf_path: ...}: not trained on); a role not placed
    # here is served by every engine of the policy.
    role_engines: list[RoleEngines] = field(default_factory=list)


@dataclass
class JudgeConfig:
    """A generative reward model (megarl/tasks/judge.py): its own SGLang engine answers ``prompt_template``
    (``{prompt}``: the prompt as the dataset wrote it, without the policy's chat template; ``{response}``,
    ``{answer}``) and ``score_pattern``'s first group, parsed as a float, is
    the score. A timeout or an answer without a score is a reward error (counted, the sample is not trained on)."""

    hf_path: Optional[str] = None  # judge checkpoint; None = no judge
    # tokenized as written by the judge's tokenizer: write a chat model's turn markers into the template
    prompt_template: str = "{prompt}{response}"
    score_pattern: str = "(-?[0-9]+(?:\\.[0-9]+)?)"  # searched in the decoded answer; group 1 = the score
    max_new_tokens: int = setting(8, ge=1)
    temperature: float = setting(0.0, ge=0)  # 0 = greedy
    weight: float = setting(1.0, ge=0)  # reward = rule_weight * rule + weight * judge
    timeout_s: float = setting(30.0, gt=0)  # per judge request; at most reward.timeout_s
    # score every policy turn of a multi-turn episode instead of the whole response: weight * score of
    # turn k -> sample.turn_rewards[k] (process rewards, megarl/algos/process.py); reward = rule_weight * rule
    per_turn: bool = False
    engine_tp: int = setting(1, ge=1)  # tensor-parallel ranks of the judge engine
    engine_ep: int = setting(1, ge=1)  # its expert-parallel ranks (dividing engine_tp)


@dataclass
class RewardConfig:
    """How samples are scored (megarl/tasks/rewards.py). A reward that raises or exceeds
    timeout_s gives the sample reward 0 and finish_reason error (counted, never fatal)."""

    # arithmetic | exact_match | math (math-verify) | remote | function
    type: str = setting("arithmetic", choices=REWARD_TYPES)
    path: Optional[str] = None  # function: dotted path "package.module.function" taking a RewardInput
    url: Optional[str] = None  # remote: reward-model endpoint (POST JSON, answers {"reward": float})
    timeout_s: float = setting(30.0, gt=0)
    # weight of the ``type`` reward when a judge is configured (0: not computed)
    rule_weight: float = setting(1.0, ge=0)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class TeacherConfig:
    """On-policy distillation: a teacher served by its own SGLang engine scores the student's samples
    (one prefill request per sample: the log-prob of every response token)."""

    hf_path: Optional[str] = None  # teacher checkpoint; None = no teacher
    timeout_s: float = setting(60.0, gt=0)
    # the teacher engine's tensor-parallel ranks; None = rollout.engine_tp
    engine_tp: Optional[int] = setting(None, ge=1)
    # its expert-parallel ranks (dividing engine_tp); None = rollout.engine_ep
    engine_ep: Optional[int] = setting(None, ge=1)


@dataclass
class RolloutConfig:
    num_engines: int = setting(1, ge=1)
    engine_tp: int = setting(1, ge=1)
    engine_ep: int = setting(1, ge=1)
    engine_dp_attention: bool = False
    # SGLang --mem-fraction-static: the share of each engine GPU (of the memory free when it starts) for the
    # weights and the KV cache; the teacher's, judge's and frozen roles' engines take it too
    mem_fraction_static: float = setting(0.8, gt=0, lt=1)
    # engine KV-cache capacity in tokens; None = SGLang sizes it from memory
    max_total_tokens: Optional[int] = setting(None, ge=1)
    prefix_cache: bool = True  # SGLang's radix prefix cache (false: --disable-radix-cache)
    # a prompt of at least this many tokens that a batch sends to an engine more than once (a GRPO group's) is
    # prefilled there once first, so its copies read it from the prefix cache; 0 = off, as it is with
    # prefix_cache false (SGLang prefills a batch's requests side by side, each copy computing the prompt)
    shared_prefill_min_tokens: int = setting(32, ge=0)
    # a prompt group's requests (every turn of its episodes) go to the engine that served the group (which holds
    # their prefixes) unless that engine has this many more prompts in flight than the least-loaded one
    affinity_slack: int = setting(64, ge=0)
    prompts_per_step: int = setting(64, ge=1)
    samples_per_prompt: int = setting(8, ge=1)  # G, the GRPO group size
    max_new_tokens: int = setting(3, ge=1)
    temperature: float = setting(1.0, ge=0)
    top_p: float = setting(1.0, gt=0, le=1)
    top_k: int = setting(20, ge=1, also=(-1,))  # finite whenever keep_sampling_mask is on
    keep_routing: bool = True
    keep_sampling_mask: bool = True
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal and refill
    kv_cache_gb: Optional[float] = setting(None, gt=0)  # planner: KV cache per engine; None = what is left
    # planner: longest prompt in tokens (KV cache must hold prompt + response)
    max_prompt_tokens: int = setting(1024, ge=1)
    # SGLang's parser of the tool calls an agent's model writes (task.agent's gateway); null: the model family's
    # (megarl/agents/parsers.py, e.g. qwen3_moe -> qwen25)
    tool_call_parser: Optional[str] = None
    # seconds between the driver's probes of each policy engine (its weight version, answered within this)
    engine_health_check_s: float = setting(5.0, gt=0)
    # seconds an engine may stay silent (or take to restart) while another engine serves before it is lost:
    # its requests go to the other engines and it rejoins with a full weight sync once it answers again
    engine_lost_s: float = setting(60.0, gt=0)
    # engines may join the running job up to this many, one per free megarl_engine unit of the Ray cluster
    # (docs/elastic_engines.md); None = the pool never grows beyond num_engines
    max_engines: Optional[int] = setting(None, ge=1)
    # seconds a leaving engine's requests may run before they are resubmitted to the other engines
    engine_drain_s: float = setting(60.0, ge=0)


@dataclass
class AlgorithmConfig:
    """What each name means, with the peers' (verl, slime, SkyRL, AReaL, prime-rl) formula it follows: the
    docstrings of ``megarl/algos/``. Off-policy correction: ``w`` is the trainer/rollout probability ratio at
    ``off_policy_level``; rejected tokens (mis, off_policy_rejection, the vetoes, off_policy_mask_kl) leave the
    loss. Metrics of the step (``metrics.jsonl`` and TensorBoard, under these names): ``train/loss``,
    ``train/pg_loss``, ``train/kl``, ``train/entropy``, ``train/clip_fraction``, ``train/clip_fraction_low``,
    ``train/clip_fraction_high``, ``train/dual_clip_fraction``, ``train/cov_fraction`` (clip_cov, kl_cov),
    ``train/is_weight_mean``, ``train/rejected_tokens``, ``train/rejected_sequences``, ``train/ppo_kl``; with the
    engine's log-probs, the trainer against the engine (verl's names): ``off_policy/rollout_is_mean``,
    ``off_policy/rollout_is_max``, ``off_policy/rollout_is_min``, ``off_policy/rollout_is_std``,
    ``off_policy/rollout_is_ratio_fraction_high``, ``off_policy/rollout_is_ratio_fraction_low`` (token weights
    against is_threshold), ``off_policy/ess``, ``off_policy/kl``, ``off_policy/k3_kl``, ``off_policy/chi2_token``,
    ``off_policy/chi2_seq``, ``off_policy/training_ppl``, ``off_policy/rollout_ppl``, ``off_policy/log_ppl_diff``
    (signed, per sequence rollout minus trainer mean log-prob), ``off_policy/log_ppl_diff_max``,
    ``off_policy/log_ppl_diff_min``, ``off_policy/log_ppl_abs_diff``, ``off_policy/ppl_ratio``; policy_loss=cispo:
    ``cispo/ratio_mean``, ``cispo/ratio_clamped_mean``, ``cispo/ratio_max``, ``cispo/ratio_min`` (over the tokens
    in the loss); score_centering: ``score_centering/support_tv``, ``score_centering/head_mass``; kl_in_reward:
    ``kl/coef`` (the coefficient the step's rewards took) and ``kl/reward_kl`` (the batch's mean token KL)."""

    # grpo | dr_grpo | rloo | reinforce_pp (REINFORCE++-baseline, whitened over tokens) | maxrl ((r - mean) /
    # (mean + 1e-6), SkyRL) | reinforce_plus_plus (verl's REINFORCE++: token returns discounted by gamma, whitened)
    # | opd (0: the teacher's alone) | gae (PPO with a value model: verl's compute_gae_advantage_return over the
    # critic's values, needs critic.enabled; megarl/algos/gae.py)
    advantage: str = setting("grpo", choices=(*ADVANTAGES, *TOKEN_LEVEL, *CRITIC_ADVANTAGES))
    gamma: float = setting(1.0, ge=0, le=1)  # gae, reinforce_plus_plus: discount per token
    lam: float = setting(1.0, ge=0, le=1)  # gae: the lambda of GAE (1: Monte-Carlo returns minus values)
    # ppo | gspo | cispo | sapo | dppo (DPPO's binary trust-region mask) | clip_cov | kl_cov (the covariance losses)
    policy_loss: str = setting("ppo", choices=tuple(POLICY_LOSSES))
    # the PPO ratio's old policy: recompute (the trainer's log-probs before the step's first update, one
    # forward-only pass when trainer.updates_per_step > 1) | rollout (the engine's log-probs: verl's bypass mode,
    # the ratio to the rollout policy is the off-policy correction; off_policy_correction must be none)
    old_policy: str = setting("recompute", choices=OLD_POLICIES)
    clip_low: float = setting(0.2, ge=0)  # ratio band [1 - clip_low, 1 + clip_high] of ppo, gspo, cispo, clip_cov
    clip_high: float = setting(0.2, ge=0)
    clip_absolute: bool = False  # cispo: the IS-weight bounds are [clip_low, clip_high] themselves (lower may be 0)
    dual_clip: Optional[float] = setting(None, gt=1)  # c > 1 for PPO dual clip
    sapo_tau_pos: float = setting(1.0, gt=0)  # sapo: gate temperature for tokens with advantage > 0 (verl tau_pos)
    sapo_tau_neg: float = setting(1.05, gt=0)  # sapo: gate temperature for advantage <= 0 (verl tau_neg)
    # dppo: binary_tv (|p - p_old| trust region) | binary_kl (binary KL of the sampled token's probability)
    dppo_type: str = setting("binary_tv", choices=DPPO_TYPES)
    dppo_delta_low: float = setting(0.2, ge=0)  # dppo: the divergence bound for tokens with advantage < 0
    dppo_delta_high: float = setting(0.2, ge=0)  # dppo: the divergence bound for tokens with advantage > 0
    # clip_cov: the share of trained tokens detached at most (at least one) among those of covariance in
    # (clip_cov_lb, clip_cov_ub) (verl clip_cov_ratio)
    clip_cov_ratio: float = setting(2e-4, gt=0, le=1)
    # clip_cov: the covariance band (clip_cov_lb, clip_cov_ub) of the candidates (lb below ub)
    clip_cov_lb: float = setting(1.0, ge=-1000, le=1000)
    clip_cov_ub: float = setting(5.0, ge=-1000, le=1000)
    kl_cov_ratio: float = setting(2e-4, gt=0, le=1)  # kl_cov: share of trained tokens of largest covariance penalised
    kl_cov_coef: float = setting(1.0, ge=0)  # kl_cov: weight of |logp - logp_old| on them (verl ppo_kl_coef)
    # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm (Dr.GRPO: sum / (B * C))
    # | prompt_mean (token mean within each prompt group, then the mean over groups; SkyRL)
    loss_agg: str = setting("token_mean", choices=tuple(AGGREGATIONS))
    # C of seq_mean_token_sum_norm (verl loss_scale_factor)
    loss_scale_factor: int = setting(II("rollout.max_new_tokens"), ge=1)
    kl_coef: float = setting(0.0, ge=0)  # weight of the KL to the reference policy (the starting checkpoint)
    # k1 | k2 | k3 | low_var_kl (k3 clamped to [-10, 10]) | k1_is | k2_is | k3_is (x pi/pi_old) | low_var_kl_is
    # (clamp(pi/pi_old * k3, -10, 10), slime's clamp after the weight) | abs (|k1|, verl's and SkyRL's)
    kl_type: str = setting("k3", choices=tuple(KL_ESTIMATORS))
    kl_in_reward: bool = False  # true: reward - kl_coef * sum_t KL_t pre-advantage (verl use_kl_in_reward); false: loss
    # fixed (kl_coef throughout) | adaptive (verl's AdaptiveKLController from kl_coef towards kl_target; needs
    # kl_in_reward, where verl applies it)
    kl_ctrl: str = setting("fixed", choices=KL_CONTROLLERS)
    kl_target: float = setting(0.1, gt=0)  # adaptive: the mean token KL it steers towards
    kl_horizon: float = setting(10000.0, gt=0)  # adaptive: samples over which an error of 20% moves kl_coef by 20%
    entropy_coef: float = setting(0.0, ge=0)
    # on-policy distillation: per-token advantage opd_coef * (teacher_logp - student_logp) (needs teacher.hf_path);
    # alone with advantage=opd, added to the reward advantage otherwise
    opd_coef: float = setting(0.0, ge=0)
    # none (slime, miles: teacher_logp - student_logp as it is) | batch_mean (tinker-cookbook: minus its mean over
    # the batch's trained tokens, a baseline that keeps the gradient's expectation and cuts its variance)
    opd_baseline: str = setting("none", choices=OPD_BASELINES)
    # none | tis (w clamped to [is_threshold_low, is_threshold]) | mis (reject tokens/sequences with w outside it)
    off_policy_correction: str = setting("none", choices=CORRECTIONS)
    # token | sequence (product of token ratios) | geometric (their geometric mean)
    off_policy_level: str = setting("token", choices=LEVELS)
    is_threshold: float = setting(2.0, ge=1)  # upper bound C of w (>= 1)
    # lower bound of w in [0, 1]; null: 0 for tis, 1 / is_threshold for mis
    is_threshold_low: Optional[float] = setting(None, ge=0, le=1)
    # reject a sequence with a token ratio below this (e.g. 1e-4)
    off_policy_veto_threshold: Optional[float] = setting(None, gt=0, le=1)
    # reject a sequence with a token ratio above this (SkyRL's outlier_token_is_threshold_high, e.g. 100)
    off_policy_veto_threshold_high: Optional[float] = setting(None, ge=1)
    # verl's rejection criteria (rollout_rs), comma-separated, all must pass: token_k1..3, seq_sum_k1..3,
    # seq_mean_k1..3, seq_max_k2..3 (megarl/algos/rejection.py); independent of the weight of off_policy_correction
    off_policy_rejection: Optional[str] = None
    # their thresholds (rollout_rs_threshold): one for all or one each, comma-separated; k1: "lower_upper" or upper
    # (quote it: unquoted, YAML and Hydra read 0.5_2 as the number 0.52)
    off_policy_rejection_threshold: Optional[str] = None
    # reject sequences with A < 0 and KL to the rollout policy > this
    off_policy_mask_kl: Optional[float] = setting(None, ge=0)
    # none | exact (each token's score centred by its expectation under the engine's distribution over the recorded
    # top-k/top-p support: needs rollout.keep_sampling_mask) | tail (over the support's score_centering_head most
    # probable ids, the rest of the engine's mass modelled proportional to the trainer's); composes with
    # off_policy_correction (megarl/algos/score_centering.py)
    score_centering: str = setting("none", choices=SCORE_CENTERING)
    score_centering_head: int = setting(8, ge=1)  # tail: recorded ids kept per token (the engine's most probable)


@dataclass
class BufferConfig:
    max_staleness: int = setting(1, ge=0)
    max_buffer_batches: int = setting(2, ge=1)
    # continue (retract: requests resume on the new weights) | abort_resubmit | in_place (requests keep their KV
    # cache across the sync; tokens the new weights sample over the old cache are left out of the loss)
    partial_rollout: str = setting("continue", choices=PARTIAL_ROLLOUT_MODES)
    # a checkpoint carries the buffer's groups and the samples so far of the groups in flight (their requests
    # aborted once to read them and resubmitted), which a resumed run continues; false: generated anew
    carry_in_flight: bool = True


@dataclass
class ClusterConfig:
    """The machines a layout is placed on (planner: ``python -m megarl.plan`` reports which node and
    device holds each trainer and engine rank, and refuses a layout that cannot be placed)."""

    # devices per node; trainer ranks, then engines (disaggregated), fill nodes in order; an engine of more
    # ranks spans engine_tp / gpus_per_node whole nodes (SGLang --nnodes: a server a node, HTTP on the first)
    gpus_per_node: int = setting(8, ge=1)
    num_nodes: Optional[int] = setting(None, ge=1)  # nodes available; None = as many as the layout needs
    # host memory of one node, GiB: the host copies delta syncs keep (sync.delta) may take half of it; None = the
    # driver's node's, read at start (the planner then reports them unchecked)
    host_memory_gb: Optional[float] = setting(None, gt=0)
    # seconds between the driver's checks that every trainer rank's node is alive in Ray and every rank's process
    # answers; a lost node or rank ends the run (exit status 75) within this plus Ray's own detection of the
    # death, its last checkpoint intact
    node_check_s: float = setting(5.0, gt=0)


@dataclass
class EvalConfig:
    """Held-out evaluation during the run (megarl/pipeline/evaluation.py): the policy's engines answer held-out
    prompts, never in the training stream (the arithmetic task: problems its own seed picks, left out of training;
    jsonl / parquet: the file eval.path without rows the training file holds, else rows of task.path its seed picks,
    left out of training), under one
    weight version each time, beside the training stream; eval/* rows in metrics.jsonl, the trackers and
    curves.png."""

    interval: int = setting(0, ge=0)  # steps between evaluations, and one after the last step; 0 = no evaluation
    before_training: bool = False  # also evaluate the starting weights (a new run's version 0)
    prompts: int = setting(32, ge=1)  # held-out prompts evaluated each time
    samples_per_prompt: int = setting(4, ge=1)  # sampled answers a prompt (n of pass@k)
    pass_k: int = setting(4, ge=1)  # the k of eval/pass@k besides pass@1, at most samples_per_prompt
    temperature: float = setting(1.0, gt=0)  # of the sampled answers (the greedy ones: 0)
    greedy: bool = True  # one greedy answer a prompt too (eval/greedy/*)
    pass_threshold: float = setting(1.0, ge=-1e6, le=1e6)  # an answer passes (pass@k) with a reward at least this
    # jsonl / parquet tasks: a held-out dataset file (task.path's format and keys; its rows that task.path also holds
    # are left out); None = eval.prompts rows of task.path held out, never trained on
    path: Optional[str] = None
    seed: int = setting(1, ge=0)  # picks the held-out problems (arithmetic) or rows of task.path


@dataclass
class LoggingConfig:
    run_dir: str = "runs/${run_name}"  # metrics.jsonl and the resolved config.yaml go here
    # where metrics.jsonl's rows also go: tensorboard (run_dir/tensorboard) | wandb | mlflow
    # (megarl/metrics/trackers.py; wandb and mlflow are optional packages, pinned in requirements.lock)
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class MegarlConfig:
    run_name: str = "run"
    # one of MODES (warmup: the supervised warm-up alone, for the tiny demos)
    mode: str = setting("async", choices=MODES)
    placement: Placement = Placement.colocated
    steps: int = setting(100, ge=1)  # RL steps
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
