"""The judge of a run (``reward.judge``, megarl/tasks/judge.py) on its engine: the engine's settings
from the config and the :class:`~megarl.tasks.judge.JudgeReward` that asks it.

The judge engine is one more SGLang server, apart from the policy's pool: it is never paused and
never gets weight updates. A run starts it like the policy engines (``EnginePool.launch`` of the
settings, one engine) and passes ``make_judge(cfg.reward.judge, judge_pool, tokenizer)`` to ``make_reward``.
"""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from megarl.engines.protocol import Engines
from megarl.engines.server import EngineSettings, nodes_of
from megarl.engines.types import SamplingParams
from megarl.tasks.judge import JudgeGenerate, JudgeReward


def judge_engine_settings(cfg, api_key: str | None = None) -> EngineSettings:
    """The judge engine of the run ``cfg``: ``reward.judge.hf_path`` on ``reward.judge.engine_tp``
    ranks (``engine_ep`` of them expert-parallel), in the run's dtype, KV-cache size and memory share
    (``model.dtype``, ``rollout.max_total_tokens``, ``rollout.mem_fraction_static``), its log
    ``judge-engine.log`` in the run directory. Not ``EngineSettings.from_config``: that takes the policy
    engines' tp/ep, which need not fit the judge's model."""
    judge = cfg.reward.judge
    if not judge.hf_path:
        raise ValueError("reward.judge.hf_path: no judge configured")
    return EngineSettings(model_path=judge.hf_path, dtype=cfg.model.dtype,
                          max_total_tokens=cfg.rollout.max_total_tokens,
                          mem_fraction_static=cfg.rollout.mem_fraction_static, random_seed=cfg.task.seed,
                          tp=judge.engine_tp, ep=judge.engine_ep,
                          nnodes=nodes_of(judge.engine_tp, cfg.cluster.gpus_per_node),
                          log_path=str(Path(cfg.logging.run_dir) / "judge-engine.log"), api_key=api_key)


def judge_generate(engines: Engines, judge_cfg) -> JudgeGenerate:
    """The judge's generate call on ``engines`` (an ``SGLangClient`` or ``EnginePool``): one request
    per judge prompt, ``reward.judge.max_new_tokens`` at ``temperature``, without routing or masks."""
    params = SamplingParams(max_new_tokens=judge_cfg.max_new_tokens, temperature=judge_cfg.temperature)

    async def generate(prompt_ids: list[int]) -> list[int]:
        [answer] = await engines.generate_batch([prompt_ids], params, group_ids=["judge"],
                                                return_routed_experts=False, return_sampling_mask=False)
        return answer.response_ids

    return generate


def make_judge(judge_cfg, engines: Engines, policy_tokenizer) -> JudgeReward:
    """The judge reward of ``reward.judge`` on ``engines``, with the judge checkpoint's own tokenizer."""
    return JudgeReward(judge_cfg, judge_generate(engines, judge_cfg), AutoTokenizer.from_pretrained(judge_cfg.hf_path),
                       policy_tokenizer)
