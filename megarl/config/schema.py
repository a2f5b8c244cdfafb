"""The typed Hydra schema of a megarl run.

Every recipe in ``recipes/`` composes onto :class:`MegarlConfig`; Hydra rejects unknown keys and
wrong types. Each field declares its range or its names once (:func:`megarl.fields.setting`), checked
for every section by :func:`megarl.fields.out_of_bounds`; :mod:`megarl.config.validate` rejects
impossible combinations (layouts that do not divide, MoE with TP>1 and no sequence parallel, ...). A
component that owns its section declares it beside its code and the schema nests it: ``algorithm``
(:mod:`megarl.algos.settings`), ``trainer``, ``critic`` and ``warmup`` (:mod:`megarl.trainer.settings`),
``sync`` (:mod:`megarl.sync.settings`), ``lora`` (:mod:`megarl.models.lora`). Units are in the field names
or comments.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import MISSING

from megarl.algos.settings import AlgorithmConfig
from megarl.config.topology import Placement, RunTopology
from megarl.fields import setting
from megarl.metrics.trackers import MlflowConfig, WandbConfig
from megarl.models.lora import LoraConfig
from megarl.rollout.env import ENVIRONMENTS
from megarl.rollout.group import PARTIAL_ROLLOUT_MODES
from megarl.sync.settings import SyncConfig
from megarl.tasks.prompts import TASKS
from megarl.tasks.rewards import REWARD_TYPES
from megarl.trainer.settings import DTYPES, CriticConfig, TrainerConfig, WarmupConfig

ARCH_FAMILIES = ("qwen3_moe", "deepseek_v3", "glm4_moe")  # model.arch.family: the planner's architectures

# What ``python -m megarl.train`` runs (a string: ``async`` cannot name an Enum member):
#   warmup        supervised warm-up only (saves the HF checkpoint RL starts from)
#   sync          RL, buffer depth one batch, sync after every step
#   one_step_off  RL, generation runs one step ahead of training
#   async         RL, two free-running loops joined by the buffer
MODES = ("warmup", "sync", "one_step_off", "async")


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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class TeacherConfig:
    """On-policy distillation: a teacher served by its own SGLang engine scores the student's samples
    (one prefill request per sample: the log-prob of every response token)."""

    hf_path: Optional[str] = None  # teacher checkpoint; None = no teacher
    timeout_s: float = setting(60.0, gt=0)
    # the teacher engine's tensor-parallel ranks; None = rollout.engine_tp
    engine_tp: Optional[int] = setting(None, ge=1)
    # its expert-parallel ranks (dividing engine_tp); None = rollout.engine_ep
    engine_ep: Optional[int] = setting(None, ge=1)


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class BufferConfig:
    max_staleness: int = setting(1, ge=0)
    max_buffer_batches: int = setting(2, ge=1)
    # continue (retract: requests resume on the new weights) | abort_resubmit | in_place (requests keep their KV
    # cache across the sync; tokens the new weights sample over the old cache are left out of the loss)
    partial_rollout: str = setting("continue", choices=PARTIAL_ROLLOUT_MODES)
    # a checkpoint carries the buffer's groups and the samples so far of the groups in flight (their requests
    # aborted once to read them and resubmitted), which a resumed run continues; false: generated anew
    carry_in_flight: bool = True


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class LoggingConfig:
    run_dir: str = "runs/${run_name}"  # metrics.jsonl and the resolved config.yaml go here
    # where metrics.jsonl's rows also go: tensorboard (run_dir/tensorboard) | wandb | mlflow
    # (megarl/metrics/trackers.py; wandb and mlflow are optional packages, pinned in requirements.lock)
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass(frozen=True)
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

    @functools.cached_property
    def topology(self) -> RunTopology:
        """The run's engine pools and devices, computed once from this config (the whole run reads this one)."""
        return RunTopology.from_config(self)

    @functools.cached_property
    def enabled_lora(self) -> LoraConfig | None:
        """The ``lora`` section, checked and with its targets a tuple, when adapters are trained; else None."""
        return LoraConfig.when_enabled(self.lora)
