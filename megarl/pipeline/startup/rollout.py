"""The rollout of a run: what turns prompts into scored groups in the buffer.

:func:`start_rollout` builds the prompt source (at a resumed run's data position, without the held-out
prompts of the evaluation, whose managers it builds too: ``eval.*``), the reward (with
the judge on its engine, ``reward.judge``), the teacher's scorer (``teacher.hf_path``), the agent
workers (``task.agent_workers``), the episode runner of multi-turn tasks (:func:`episode_runner`), the
:class:`RolloutManager` on the policy pool, the bounded buffer and the producer that fills it; the
producer is not started.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from omegaconf import DictConfig

from megarl.agents.gateway import AgentGateway, GatewaySettings
from megarl.agents.parsers import tool_call_parser
from megarl.agents.rollout import AgentEpisodes
from megarl.agents.spec import load_agent
from megarl.agents.workers import AgentWorkerError, AgentWorkers
from megarl.engines.pool import EnginePool
from megarl.engines.protocol import Engines
from megarl.engines.types import EngineUnreachable, GenerationOptions, SamplingParams
from megarl.models.hf_config import read_hf_config
from megarl.parallel.network import node_address
from megarl.pipeline.buffer import RolloutBuffer
from megarl.pipeline.evaluation import EVAL_PRIORITY
from megarl.pipeline.judge import make_judge
from megarl.pipeline.modes import lag_and_capacity
from megarl.pipeline.producer import ProducerStart, Production, RolloutProducer
from megarl.pipeline.startup.trainer import Resumed
from megarl.rollout.env import EnvEpisodes, EpisodeLimits, make_env_factory
from megarl.rollout.group import RolloutManager
from megarl.rollout.teacher import TeacherScorer
from megarl.tasks.heldout import arithmetic_heldout, dataset_heldout, training_rows_heldout
from megarl.tasks.prompts import Prompt, chat_renderer, make_prompt_source
from megarl.tasks.rewards import RewardScorer, make_reward

log = logging.getLogger(__name__)


@dataclass
class EvalParts:
    """What a run's evaluation runs on (``eval.*``): the held-out prompts and the managers of the sampled and
    the greedy answers (None: no greedy answers)."""

    prompts: list[Prompt]
    sampled: RolloutManager
    greedy: RolloutManager | None


@dataclass
class Rollout:
    """What :func:`start_rollout` built: the producer (not started), the buffer it fills, the
    teacher's scorer when the run distils from one, and the evaluation's parts when the run evaluates."""

    producer: RolloutProducer
    buffer: RolloutBuffer
    teacher: TeacherScorer | None
    evaluation: EvalParts | None = None


@dataclass
class _Shared:
    """What the training's and the evaluation's managers share: the teacher's scorer (the training's
    alone uses it) and the agent workers (None: agents run in the driver)."""

    teacher: TeacherScorer | None
    agent_workers: AgentWorkers | None


def episode_runner(cfg: DictConfig, target: EnginePool, tokenizer, params: SamplingParams,
                   frozen: Mapping[str, Engines] | None = None, model_type: str | None = None,
                   agent_workers: AgentWorkers | None = None):
    """What turns a prompt into multi-turn episodes: an environment (``task.env``), an agent program
    behind the OpenAI gateway (``task.agent``; its roles on the engines ``task.role_engines`` names,
    ``frozen``: role -> the engine of the frozen model serving it; its tool calls read by
    ``rollout.tool_call_parser``, or the parser of ``model_type``, the policy's family; its episodes in
    ``agent_workers``, the gateway then on this node's routable address), or None for single-turn prompts."""
    task = cfg.task
    if task.agent is not None:
        frozen = dict(frozen or {})
        # a role task.role_engines does not place is served by all the policy's engines (None)
        placed = {entry.role: frozen[entry.role] if entry.hf_path else target.subset(entry.engines)
                  for entry in task.role_engines}
        roles = {role: placed.get(role) for role in task.roles} if task.roles else None
        generation = GenerationOptions(params, routing=cfg.rollout.keep_routing, sampling_mask=cfg.rollout.top_k > 0)
        settings = GatewaySettings(max_turns=task.max_turns, max_response_tokens=task.max_response_tokens,
                                   partial_rollout=cfg.buffer.partial_rollout, frozen_roles=frozenset(frozen),
                                   tool_call_parser=tool_call_parser(cfg.rollout.tool_call_parser, model_type),
                                   host=node_address() if agent_workers is not None else "127.0.0.1")
        gateway = AgentGateway(target, tokenizer, generation, settings, roles)
        return AgentEpisodes(gateway, load_agent(task.agent), timeout_s=task.agent_timeout_s, workers=agent_workers)
    if task.env is None:
        return None
    budget = task.max_response_tokens or target.model.context_length  # and each episode's context
    return EnvEpisodes(target, tokenizer, make_env_factory(task.env), params,
                       EpisodeLimits(max_turns=task.max_turns, max_response_tokens=budget),
                       routing=cfg.rollout.keep_routing, sampling_mask=cfg.rollout.top_k > 0,
                       abort_resubmit=cfg.buffer.partial_rollout == "abort_resubmit")


def _teacher(cfg: DictConfig, pools: Mapping[str, EnginePool], api_key: str,
             stack: contextlib.AsyncExitStack) -> TeacherScorer | None:
    """The scorer of the teacher's engine (``pools["teacher"]``), None without a teacher."""
    if "teacher" not in pools:
        return None
    teacher = TeacherScorer(pools["teacher"].clients[0].base_url, pools["teacher"].model.vocab_size,
                            api_key=api_key, timeout_s=cfg.teacher.timeout_s)
    stack.push_async_callback(teacher.aclose)
    log.info("teacher %s served at %s", cfg.teacher.hf_path, teacher.base_url)
    return teacher


def _agent_workers(cfg: DictConfig, stack: contextlib.AsyncExitStack) -> AgentWorkers | None:
    """The run's agent workers (``task.agent_workers`` > 0 with ``task.agent``), None otherwise."""
    task = cfg.task
    if task.agent is None or not task.agent_workers:
        return None
    workers = AgentWorkers(task.agent_workers, task.agent_worker_cpus, task.agent_worker_episodes)
    stack.push_async_callback(workers.aclose)
    log.info("%d agent workers, %d episodes each at once", task.agent_workers, task.agent_worker_episodes)
    return workers


def _manager(cfg: DictConfig, start_checkpoint: str, tokenizer, pools: Mapping[str, EnginePool],
             shared: _Shared, stack: contextlib.AsyncExitStack, evaluation: str | None = None,
             samples_per_prompt: int | None = None) -> RolloutManager:
    """The rollout manager on the policy pool, with the run's reward, episodes and teacher; ``evaluation``
    ``"sampled"`` / ``"greedy"``: one of the evaluation's (``eval.temperature`` / greedy, ``samples_per_prompt``
    answers, no routes, masks nor teacher, ahead of the training stream in the engines' queues: ``EVAL_PRIORITY``)."""
    r, pool = cfg.rollout, pools["policy"]
    judge = make_judge(cfg.reward.judge, pools["judge"], tokenizer) if "judge" in pools else None
    temperature = {None: r.temperature, "sampled": cfg.eval.temperature, "greedy": 0.0}[evaluation]
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=temperature, top_p=r.top_p,
                            top_k=r.top_k, priority=0 if evaluation is None else EVAL_PRIORITY)
    # The engine's log-probs are always those of the distribution it sampled from (renormalised
    # over its top-k mask); keep_sampling_mask decides whether the trainer applies that mask too.
    frozen = {a.role: pools[a.name] for a in cfg.topology.auxiliary if a.role is not None}
    episodes = episode_runner(cfg, pool, tokenizer, params, frozen, read_hf_config(start_checkpoint).model_type,
                              shared.agent_workers)
    if isinstance(episodes, AgentEpisodes):
        stack.push_async_callback(episodes.aclose)
    training = evaluation is None
    scorer = RewardScorer(make_reward(cfg.reward, judge=judge), cfg.reward.timeout_s)
    generation = GenerationOptions(params, routing=r.keep_routing and training, sampling_mask=r.top_k > 0 and training)
    return RolloutManager(pool, tokenizer, scorer, generation, samples_per_prompt or r.samples_per_prompt,
                          episodes=episodes, teacher=shared.teacher if training else None,
                          add_special_tokens=not cfg.task.chat_template)


def heldout_prompts(cfg: DictConfig, tokenizer) -> tuple[list[Prompt], frozenset[str]]:
    """The run's held-out prompts (:mod:`megarl.tasks.heldout`) and what the training source leaves out for
    them (the arithmetic task's prompts, a dataset's rows; none for a dataset evaluated on ``eval.path``)."""
    e, task = cfg.eval, cfg.task
    if task.name == "arithmetic":
        return arithmetic_heldout(task.max_operand, e.prompts, e.seed)
    keys = dict(prompt_key=task.prompt_key, answer_key=task.answer_key or None, file_format=task.name,
                render=chat_renderer(tokenizer) if task.chat_template else None)
    if e.path:
        return dataset_heldout(e.path, task.path, e.prompts, **keys)[0], frozenset()
    return training_rows_heldout(task.path, e.prompts, e.seed, **keys)


def _evaluation(cfg: DictConfig, start_checkpoint: str, tokenizer, pools: Mapping[str, EnginePool],
                prompts: list[Prompt], shared: _Shared, stack: contextlib.AsyncExitStack) -> EvalParts:
    """The evaluation's parts: its managers on the policy pool."""
    sampled = _manager(cfg, start_checkpoint, tokenizer, pools, shared, stack, "sampled", cfg.eval.samples_per_prompt)
    greedy = _manager(cfg, start_checkpoint, tokenizer, pools, shared, stack, "greedy", 1) if cfg.eval.greedy else None
    return EvalParts(prompts=prompts, sampled=sampled, greedy=greedy)


def start_rollout(cfg: DictConfig, start_checkpoint: str, tokenizer, pools: Mapping[str, EnginePool],
                  resumed: Resumed, api_key: str, stack: contextlib.AsyncExitStack) -> Rollout:
    """The rollout of the run ``cfg`` on ``pools`` (pool name -> pool, :mod:`.engines`), generating
    for the policy at ``start_checkpoint`` (its ``tokenizer``) from where ``resumed`` says the run
    starts; ``api_key``: the engines'. What needs closing goes into ``stack``."""
    r = cfg.rollout
    teacher = _teacher(cfg, pools, api_key, stack)
    shared = _Shared(teacher, _agent_workers(cfg, stack))
    manager = _manager(cfg, start_checkpoint, tokenizer, pools, shared, stack)
    evaluates = cfg.eval.interval > 0 or cfg.eval.before_training
    prompts, held_out = heldout_prompts(cfg, tokenizer) if evaluates else ([], frozenset())
    source = make_prompt_source(cfg.task, tokenizer, exclude=held_out)
    if resumed.position is not None:
        source.load_state_dict(resumed.position["source"])
    lag, capacity, max_staleness = lag_and_capacity(cfg)
    buffer = RolloutBuffer(capacity, max_staleness, resumed.ledger)
    production = Production(prompts_per_step=r.prompts_per_step, samples_per_prompt=r.samples_per_prompt, lag=lag,
                            dynamic_sampling=r.dynamic_sampling)
    start = ProducerStart(engine_version=resumed.step, requeue=resumed.requeue, next_index=resumed.next_index,
                          carried=resumed.carried)
    producer = RolloutProducer(manager, source, buffer, resumed.ledger, production, start,
                               fatal=(EngineUnreachable, AgentWorkerError))
    evaluation = _evaluation(cfg, start_checkpoint, tokenizer, pools, prompts, shared, stack) if evaluates else None
    return Rollout(producer=producer, buffer=buffer, teacher=teacher, evaluation=evaluation)
