"""Held-out evaluation: pass@k against the binomial formula, held-out prompts that the training stream never
draws, and an evaluation's row (one weight version, or none written) from stand-in managers."""
from __future__ import annotations

import asyncio
import json
import math
import random

import numpy as np
import pytest

from megarl.config.schema import EvalConfig
from megarl.metrics.evaluation import pass_at_k, sampled_metrics
from megarl.pipeline.evaluation import Evaluation
from megarl.rollout.group import GroupResult
from megarl.sample import FinishReason, RolloutSample
from megarl.tasks import arithmetic
from megarl.tasks.heldout import arithmetic_heldout, dataset_heldout
from megarl.tasks.prompts import ArithmeticSource, Prompt

pytestmark = pytest.mark.unit


def test_pass_at_k_is_one_minus_the_binomial_ratio():
    """Chen et al. 2021's 1 - C(n-c, k) / C(n, k), for every n <= 12, c and k; and the paper's reading of it:
    pass@1 is the share of passing answers, pass@n whether any passes."""
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
            assert pass_at_k(n, c, 1) == pytest.approx(c / n) and pass_at_k(n, c, n) == float(c > 0)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_sampled_metrics_average_over_prompts():
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0]]
    metrics = sampled_metrics(rewards, [[3, 2, 2, 1]] * 3, threshold=1.0, ks=(1, 2))
    assert metrics == pytest.approx({"eval/reward": 3.5 / 12, "eval/response_len_mean": 2.0,
                                     "eval/pass@1": (1 / 4 + 0 + 2 / 4) / 3,
                                     "eval/pass@2": ((1 - 3 / 6) + 0 + (1 - 1 / 6)) / 3})


def test_arithmetic_heldout_problems_never_enter_the_training_stream():
    prompts, held = arithmetic_heldout(9, 20, seed=1)
    assert len(prompts) == len(held) == 20 and all(p.answer == str(eval(p.text[:-1])) for p in prompts)
    assert arithmetic_heldout(9, 20, seed=1)[1] == held != arithmetic_heldout(9, 20, seed=2)[1]
    source = ArithmeticSource(9, seed=0, exclude=held)
    drawn = {p.text for p in source.next_batch(5000)}
    assert drawn == {p.prompt for p in arithmetic.all_problems(9)} - held  # the other 80, each drawn
    # without held-out problems the stream is the one it always was
    assert [p.text for p in ArithmeticSource(9, seed=3).next_batch(50)] == \
        [p.prompt for p in arithmetic.sample_problems(50, random.Random(3), 9)]
    with pytest.raises(ValueError, match="eval.prompts: 100 held-out problems leave none"):
        arithmetic_heldout(9, 100, seed=1)


def test_dataset_heldout_rows_leave_out_prompts_the_training_file_holds(tmp_path, caplog):
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    held.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i), "source": "x"}) + "\n"
                            for i in (3, 10, 4, 11, 12, 13)))
    prompts, overlapping = dataset_heldout(held, train, 3, prompt_key="prompt", answer_key="answer",
                                           file_format="jsonl")
    assert [(p.text, p.answer, p.metadata["source"]) for p in prompts] == [("q10", "10", "x"), ("q11", "11", "x"),
                                                                            ("q12", "12", "x")]
    assert overlapping == 2 and "left out 2 rows" in caplog.text
    with pytest.raises(ValueError, match="has no prompt that is not also in the training data"):
        dataset_heldout(train, train, 3, prompt_key="prompt", answer_key="answer", file_format="jsonl")


def test_training_rows_held_out_of_a_dataset_are_never_visited(tmp_path):
    """Without eval.path, eval.prompts rows of task.path (a seeded pick) are evaluated and the training source
    skips them, epoch after epoch."""
    from megarl.tasks.heldout import training_rows_heldout
    from megarl.tasks.prompts import DatasetSource

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(12)))
    prompts, rows = training_rows_heldout(train, 4, seed=1, prompt_key="prompt", answer_key="answer",
                                          file_format="jsonl")
    assert len(rows) == 4 and sorted(p.text for p in prompts) == sorted(f"q{i}" for i in rows)
    source = DatasetSource(train, seed=5, file_format="jsonl", exclude=rows)
    drawn = [p.text for p in source.next_batch(8 * 3)]  # three epochs of the 8 rows left
    assert sorted(drawn) == sorted([f"q{i}" for i in range(12) if i not in rows] * 3)
    with pytest.raises(ValueError, match="eval.prompts: 12 held-out rows leave none"):
        training_rows_heldout(train, 12, seed=1, prompt_key="prompt", answer_key="answer", file_format="jsonl")


def _answer(version: int | list[int], reward: float, tokens: int = 2) -> RolloutSample:
    versions = [version] * tokens if isinstance(version, int) else version
    return RolloutSample(prompt_ids=[1], response_ids=[5] * len(versions), loss_mask=np.ones(len(versions), np.uint8),
                         rollout_logprobs=np.zeros(len(versions), np.float32),
                         model_version=np.array(versions, np.int32), routed_experts=None, sampling_mask=None,
                         finish_reason=FinishReason.STOP, reward=reward)


class Answers:
    """A stand-in RolloutManager: per prompt text, the rewards of its answers, at the engines' ``version``."""

    def __init__(self, rewards: dict[str, list[float]], version: dict, gate: asyncio.Event | None = None):
        self.rewards, self.version, self.gate, self.asked = rewards, version, gate, []

    async def generate_groups(self, prompts, group_ids):
        self.asked.append(group_ids)
        if self.gate is not None:
            await self.gate.wait()
        return [GroupResult([_answer(self.version["now"], r) for r in self.rewards[p.text]], 0, 0) for p in prompts]


def test_an_evaluation_writes_one_row_of_its_weight_version():
    async def scenario():
        served, gate, rows = {"now": 3}, asyncio.Event(), []
        prompts = [Prompt("1+1=", "2"), Prompt("2+2=", "4")]
        sampled = Answers({"1+1=": [1.0, 0.0, 1.0, 0.0], "2+2=": [0.0, 0.0, 0.0, 0.0]}, served, gate)
        greedy = Answers({"1+1=": [1.0], "2+2=": [0.0]}, served)
        stream = iter(range(0, 1000, 10))
        evaluation = Evaluation(prompts, sampled, greedy, EvalConfig(interval=2, samples_per_prompt=4, pass_k=2),
                                write=lambda step, row: rows.append((step, row)), stream_samples=lambda: next(stream))
        assert [evaluation.due(s, 5) for s in range(1, 6)] == [False, True, False, True, True]
        evaluation.start(3)
        with pytest.raises(RuntimeError, match="version 3 is still under way"):
            evaluation.start(4)
        settling = asyncio.ensure_future(evaluation.settle())
        await asyncio.sleep(0.01)
        assert not settling.done() and rows == []  # the next sync waits for the answers
        gate.set()
        row = await settling
        assert rows == [(3, row)] and sampled.asked == [["eval3:0", "eval3:1"]]
        assert row["eval/weight_version"] == 3 and row["eval/prompts"] == 2 and row["eval/errors"] == 0
        assert row["eval/pass@1"] == pytest.approx(0.25) and row["eval/pass@2"] == pytest.approx((1 - 1 / 6) / 2)
        assert row["eval/greedy/pass"] == 0.5 and row["eval/wait_s"] > 0
        assert await evaluation.settle() is None  # none under way
        # answers whose tokens are not all of the version evaluated: no row
        served["now"] = [5, 6]
        evaluation.start(5)
        assert await evaluation.settle() is None and len(rows) == 1

    asyncio.run(scenario())


def test_eval_config_is_checked_at_load():
    from megarl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.pass_k: 8 is more than eval.samples_per_prompt"):
        load_config(["recipe=tiny_moe_cpu", "eval.pass_k=8"])
    with pytest.raises(ConfigError, match="eval.prompts: 100 held-out problems"):
        load_config(["recipe=tiny_moe_cpu", "eval.prompts=100"])
    assert load_config(["recipe=tiny_moe_cpu", "eval.interval=0", "eval.prompts=100"]).eval.prompts == 100
