"""The judge of a run (``reward.judge``, megarl/tasks/judge.py) on its engine: the
:class:`~megarl.tasks.judge.JudgeReward` that asks it.

The judge engine is one more SGLang server, apart from the policy's pool (the ``judge`` pool of the run's
topology, :mod:`megarl.config.topology`): it is never paused and never gets weight updates. A run starts it
like the policy engines and passes ``make_judge(cfg.reward.judge, judge_pool, tokenizer)`` to ``make_reward``.
"""
from __future__ import annotations

from transformers import AutoTokenizer

from megarl.engines.protocol import Engines
from megarl.engines.types import SamplingParams
from megarl.tasks.judge import JudgeGenerate, JudgeReward


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
