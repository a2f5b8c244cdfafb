"""On-policy distillation against one real SGLang server (CPU here): the student's samples scored by
a teacher checkpoint equal an HF forward of that teacher, the per-token advantage is slime's formula,
the config refuses what cannot work, and a teacher that fails costs its samples, never the run.

The one engine serves the student (the tiny checkpoint) while it generates the student's samples,
then loads the teacher's weights (the tiny checkpoint with a sharpened lm_head) and scores them."""
import asyncio
import json
import shutil

import numpy as np
import pytest
import torch
from hf_oracle import load_hf, sharpened_checkpoint

from megarl.algos.advantages import fill_advantages
from megarl.algos.distill import fill_distill_advantages, opd_token_advantages
from megarl.config import ConfigError, load_config
from megarl.config.inputs import check_inputs
from megarl.engines.types import GenerationOptions, SamplingParams
from megarl.parallel import free_port
from megarl.rollout.group import RolloutManager
from megarl.rollout.teacher import TeacherAnswerError, TeacherScorer, teacher_logprobs_from
from megarl.sample import FinishReason, RolloutSample
from megarl.tasks.prompts import Prompt
from megarl.tasks.rewards import RewardScorer, arithmetic_reward
from megarl.trainer.rl_batch import build_rl_batch

TOLERANCE = 1e-4
PROMPTS = [Prompt("3+4=", "7"), Prompt("1+8=", "9"), Prompt("6+2=", "8")]
G = 4


@pytest.fixture(scope="module")
def teacher_checkpoint(tiny_checkpoint, tmp_path_factory):
    return str(sharpened_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("teacher"), scale=3.0))


def manager(client, tokenizer, teacher=None) -> RolloutManager:
    generation = GenerationOptions(SamplingParams(max_new_tokens=6, top_k=10))
    return RolloutManager(client, tokenizer, RewardScorer(arithmetic_reward), generation, G, teacher=teacher)


@pytest.fixture(scope="module")
def student_samples(client, tokenizer, tiny_checkpoint, teacher_checkpoint, loop) -> list[RolloutSample]:
    """The student's first batch, generated on the student's weights; afterwards, for the module, the
    shared engine serves the teacher (the student's weights come back at the end)."""
    results = loop.run_until_complete(manager(client, tokenizer).generate_groups(PROMPTS, ["0", "1", "2"]))
    loop.run_until_complete(client.update_weights_from_disk(teacher_checkpoint, version=1))
    yield [s for r in results for s in r.samples]
    loop.run_until_complete(client.update_weights_from_disk(tiny_checkpoint, version=0))


@pytest.fixture(scope="module")
def teacher(tiny_engine, student_samples, loop):
    """The scorer of the engine once it serves the teacher."""
    scorer = TeacherScorer(tiny_engine.url, tiny_engine.model.vocab_size, timeout_s=30.0)
    yield scorer
    loop.run_until_complete(scorer.aclose())


def hf_response_logprobs(model, sample: RolloutSample) -> np.ndarray:
    """float64 [R]: HF's full-vocabulary log-prob (temperature 1) of each response token."""
    ids = sample.prompt_ids + sample.response_ids
    p = len(sample.prompt_ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0, p - 1:].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(sample.response_ids)[:, None])[:, 0].numpy()


def test_teacher_logprobs_of_the_students_samples_equal_an_hf_forward_of_the_teacher(
        student_samples, teacher, teacher_checkpoint, tiny_checkpoint, loop):
    samples = [s for s in student_samples if s.finish_reason is not FinishReason.ERROR]
    assert len(samples) == len(PROMPTS) * G
    failed = loop.run_until_complete(teacher.score(samples))
    assert failed == 0 and not teacher.errors
    teacher_hf, student_hf = load_hf(teacher_checkpoint), load_hf(tiny_checkpoint)
    worst, apart = 0.0, 0.0
    for sample in samples:
        r = len(sample.response_ids)
        assert sample.teacher_logprobs.dtype == np.float32 and sample.teacher_logprobs.shape == (r,)
        expected = hf_response_logprobs(teacher_hf, sample)
        worst = max(worst, float(np.abs(sample.teacher_logprobs - expected).max()))
        apart = max(apart, float(np.abs(sample.teacher_logprobs - hf_response_logprobs(student_hf, sample)).max()))
    assert worst < TOLERANCE, f"teacher log-prob vs HF: {worst}"
    assert apart > 100 * TOLERANCE, "the scores are the student's, not the teacher's"


def test_the_last_vocabulary_id_is_scored_too(student_samples, teacher, teacher_checkpoint, loop):
    """SGLang reports the id vocab_size - 1 as 0 beside its input log-prob: still that token's log-prob."""
    base, last = student_samples[0], teacher.vocab_size - 1
    sample = RolloutSample(prompt_ids=base.prompt_ids, response_ids=[last, base.response_ids[0]],
                           loss_mask=np.ones(2, np.uint8), rollout_logprobs=np.zeros(2, np.float32),
                           model_version=np.zeros(2, np.int32), routed_experts=None, sampling_mask=None,
                           finish_reason=FinishReason.STOP)
    assert loop.run_until_complete(teacher.score([sample])) == 0
    expected = hf_response_logprobs(load_hf(teacher_checkpoint), sample)
    np.testing.assert_allclose(sample.teacher_logprobs, expected, rtol=0, atol=TOLERANCE)


def test_the_manager_scores_each_group_with_the_teacher(client, tokenizer, teacher, teacher_checkpoint, loop):
    results = loop.run_until_complete(manager(client, tokenizer, teacher).generate_groups(PROMPTS[:2], ["a", "b"]))
    teacher_hf = load_hf(teacher_checkpoint)
    for result in results:
        assert result.errors == 0 and len(result.samples) == G
        for sample in result.samples:
            assert sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            expected = hf_response_logprobs(teacher_hf, sample)
            np.testing.assert_allclose(sample.teacher_logprobs, expected, rtol=0, atol=TOLERANCE)
    assert not teacher.errors and teacher.metrics() == {"distill/teacher_errors": 0.0}


# --- the advantage ---------------------------------------------------------------------------------

def slime_apply_opd_kl_to_advantages(advantages, student_log_probs, teacher_log_probs, opd_kl_coef):
    """slime/backends/megatron_utils/loss.py, apply_opd_kl_to_advantages, on per-token lists."""
    out = []
    for i, adv in enumerate(advantages):
        reverse_kl = student_log_probs[i] - teacher_log_probs[i]
        out.append(adv - opd_kl_coef * reverse_kl)
    return out


def synthetic_samples(seed: int) -> list[RolloutSample]:
    """Samples with random log-probs, rewards and loss masks (some tokens are an environment's)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(8):
        r = int(rng.integers(2, 7))
        mask = (rng.random(r) > 0.3).astype(np.uint8)
        mask[0] = 1
        samples.append(RolloutSample(
            prompt_ids=[1, 5, 9], response_ids=rng.integers(3, 200, r).tolist(), loss_mask=mask,
            rollout_logprobs=-rng.random(r).astype(np.float32) * 3, model_version=np.zeros(r, np.int32),
            routed_experts=None, sampling_mask=None, finish_reason=FinishReason.STOP, reward=float(rng.integers(0, 2)),
            group_id=str(i // 4), teacher_logprobs=-rng.random(r).astype(np.float32) * 3))
    return samples


@pytest.mark.unit
@pytest.mark.parametrize("estimator", ["opd", "grpo"])
def test_the_token_advantage_is_slimes_formula(estimator):
    samples, coef = synthetic_samples(seed=3), 0.7
    fill_advantages(samples, estimator)
    if estimator == "opd":
        assert all(s.advantage == 0.0 for s in samples)
    metrics = fill_distill_advantages(samples, coef)
    expected = slime_apply_opd_kl_to_advantages(
        [np.full(len(s.response_ids), s.advantage) for s in samples],
        [s.rollout_logprobs.astype(np.float64) for s in samples],
        [s.teacher_logprobs.astype(np.float64) for s in samples], coef)
    batch = build_rl_batch(samples, with_routing=False, with_sampling_mask=False)
    per_position = batch.position_advantages().numpy()
    for b, (sample, slime) in enumerate(zip(samples, expected)):
        trained = sample.loss_mask > 0
        np.testing.assert_allclose(sample.token_advantages[~trained], 0.0)  # environment tokens: no teacher signal
        response = per_position[batch.cu_seqlens[b] + len(sample.prompt_ids) - 1: batch.cu_seqlens[b + 1]]
        np.testing.assert_allclose(response[trained], slime[trained], rtol=1e-6, atol=1e-6)
    student = np.concatenate([s.rollout_logprobs[s.loss_mask > 0] for s in samples]).astype(np.float64)
    teacher = np.concatenate([s.teacher_logprobs[s.loss_mask > 0] for s in samples]).astype(np.float64)
    assert metrics["distill/reverse_kl"] == pytest.approx(float((student - teacher).mean()), rel=1e-9)


def tinker_incorporate_kl_penalty(sampled: list[torch.Tensor], base: list[torch.Tensor], masks: list[torch.Tensor],
                                  coef: float) -> list[torch.Tensor]:
    """tinker-cookbook's ``tinker_cookbook/rl/metrics.py`` ``incorporate_kl_penalty`` (discount 0), with the
    teacher as its base model: the KL advantage of every datum, centred by the batch's token mean."""
    diffs = [(s - b) * m for s, b, m in zip(sampled, base, masks)]
    avg = sum(d.sum() for d in diffs) / sum(m.sum() for m in masks)
    return [coef * m * (avg - d) for d, m in zip(diffs, masks)]


@pytest.mark.unit
def test_the_batch_mean_baseline_is_tinker_cookbooks_formula():
    samples, coef = synthetic_samples(seed=5), 0.7
    fill_advantages(samples, "opd")
    metrics = fill_distill_advantages(samples, coef, "batch_mean")
    expected = tinker_incorporate_kl_penalty([torch.from_numpy(s.rollout_logprobs).double() for s in samples],
                                             [torch.from_numpy(s.teacher_logprobs).double() for s in samples],
                                             [torch.from_numpy(s.loss_mask).double() for s in samples], coef)
    for sample, tinker in zip(samples, expected):
        np.testing.assert_allclose(sample.token_advantages, tinker.numpy(), rtol=1e-6, atol=1e-6)
    trained = np.concatenate([s.token_advantages[s.loss_mask > 0] for s in samples])
    assert abs(trained.mean()) < 1e-6 and trained.std() > 0.1  # centred, not flattened
    raw = synthetic_samples(seed=5)
    assert fill_distill_advantages(raw, coef) == metrics  # the baseline changes the advantages, not the KL
    with pytest.raises(ValueError, match="unknown OPD baseline 'median'"):
        fill_distill_advantages(synthetic_samples(seed=5), coef, "median")


@pytest.mark.unit
def test_the_advantage_refuses_unscored_samples_and_bad_shapes():
    samples = synthetic_samples(seed=4)
    samples[2].teacher_logprobs = None
    with pytest.raises(ValueError, match="sample 2 .* has no teacher_logprobs"):
        fill_distill_advantages(samples, 1.0)
    with pytest.raises(ValueError, match="must all be \\[R\\]"):
        opd_token_advantages(np.zeros(3, np.float32), np.zeros(2, np.float32), np.ones(3, np.uint8), 1.0)


# --- config ----------------------------------------------------------------------------------------

def config(tmp_path, *overrides):
    return load_config(["recipe=tiny_moe_cpu", f"model.hf_path={tmp_path / 'base'}",
                        f"warmup.save_hf_path={tmp_path / 'sft'}", f"logging.run_dir={tmp_path / 'run'}", *overrides])


@pytest.mark.unit
@pytest.mark.parametrize("overrides, key, why", [
    (["algorithm.advantage=opd", "algorithm.opd_coef=1.0"], "teacher.hf_path", "advantage=opd distils from a teacher"),
    (["teacher.hf_path=/t", "algorithm.opd_coef=-0.5"], "algorithm.opd_coef", "must be >= 0, got -0.5"),
    (["teacher.hf_path=/t", "algorithm.advantage=opd", "algorithm.opd_coef=1.0", "algorithm.off_policy_mask_kl=0.1"],
     "algorithm.off_policy_mask_kl", "needs per-sequence advantages"),
    (["teacher.hf_path=/t"], "algorithm.opd_coef", "the teacher's scores would train nothing"),
    (["algorithm.opd_coef=0.5"], "teacher.hf_path", "opd_coef=0.5 needs a teacher"),
    (["teacher.hf_path=/t", "algorithm.opd_coef=1.0", "algorithm.opd_baseline=group"], "algorithm.opd_baseline",
     "'group' is not one of none, batch_mean"),
    (["algorithm.advantage=opdd"], "algorithm.advantage",
     "'opdd' is not one of grpo, dr_grpo, rloo, reinforce_pp, opd"),
])
def test_config_errors_name_the_key(tmp_path, overrides, key, why):
    with pytest.raises(ConfigError) as err:
        config(tmp_path, *overrides)
    assert str(err.value).startswith(f"{key}: ") and why in str(err.value), str(err.value)


@pytest.mark.unit
def test_the_teacher_checkpoint_is_checked_before_a_run(tmp_path, tiny_checkpoint):
    student = tmp_path / "base"
    shutil.copytree(tiny_checkpoint, student)
    opd = ["algorithm.advantage=opd", "algorithm.opd_coef=1.0", "warmup.steps=0"]
    with pytest.raises(ConfigError, match=r"^teacher.hf_path: /nope is not an HF checkpoint directory"):
        check_inputs(config(tmp_path, "teacher.hf_path=/nope", *opd))
    other = tmp_path / "other_vocab"
    shutil.copytree(tiny_checkpoint, other)
    hf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(hf | {"vocab_size": hf["vocab_size"] + 128}))
    with pytest.raises(ConfigError, match=r"^teacher.hf_path: the teacher's vocabulary \(512 tokens"):
        check_inputs(config(tmp_path, f"teacher.hf_path={other}", *opd))
    check_inputs(config(tmp_path, f"teacher.hf_path={tiny_checkpoint}", *opd))  # a matching teacher passes


# --- failures --------------------------------------------------------------------------------------

class FakeTeacher:
    """A local HTTP endpoint that answers every request with ``answer`` (raw bytes), or never (None)."""

    def __init__(self, answer: bytes | None):
        self.answer, self.server, self.handlers = answer, None, set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader, writer):
        self.handlers.add(asyncio.current_task())
        try:
            await reader.read(65536)
            if self.answer is None:
                await asyncio.Event().wait()  # until stop()
            writer.write(self.answer)
            await writer.drain()
        finally:
            writer.close()

    async def stop(self):
        self.server.close()
        for task in self.handlers:
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)


def http_answer(status: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


@pytest.mark.parametrize("kind, answer", [
    ("unreachable", "closed port"),
    ("timeout", None),
    ("http_500", http_answer("500 Internal Server Error", b'{"error": "teacher crashed"}')),
    ("malformed", http_answer("200 OK", b"[]")),
])
def test_a_teacher_failure_is_counted_not_fatal(kind, answer, client, tokenizer, loop):
    fake = None
    if answer == "closed port":
        url = f"http://127.0.0.1:{free_port()}"
    else:
        fake = FakeTeacher(answer)
        url = loop.run_until_complete(fake.start())
    scorer = TeacherScorer(url, client.model.vocab_size, timeout_s=1.0)
    try:
        results = loop.run_until_complete(manager(client, tokenizer, scorer).generate_groups(PROMPTS[:2], ["x", "y"]))
    finally:
        loop.run_until_complete(scorer.aclose())
        if fake is not None:
            loop.run_until_complete(fake.stop())
    for result in results:  # every group completes with G samples, all errors with reward 0
        assert len(result.samples) == G and result.errors == G and result.rejected is None
        assert all(s.finish_reason is FinishReason.ERROR and s.reward == 0.0 and s.teacher_logprobs is None
                   for s in result.samples)
    assert scorer.errors == {kind: 2 * G}
    assert scorer.metrics() == {"distill/teacher_errors": 2.0 * G}


def test_an_answer_that_does_not_match_the_response_is_refused(student_samples, client):
    sample, vocab = student_samples[0], client.model.vocab_size
    entries = [[None, sample.prompt_ids[-1], None]] + [[-1.0, t, None] for t in sample.response_ids]
    np.testing.assert_array_equal(
        teacher_logprobs_from({"meta_info": {"input_token_logprobs": entries}}, sample, vocab),
        np.full(len(sample.response_ids), -1.0, np.float32))
    with pytest.raises(TeacherAnswerError, match="not the .* response tokens"):
        teacher_logprobs_from({"meta_info": {"input_token_logprobs": entries[1:]}}, sample, vocab)
    unscored = entries[:1] + [[None, *e[1:]] for e in entries[1:]]
    with pytest.raises(TeacherAnswerError, match="non-finite"):
        teacher_logprobs_from({"meta_info": {"input_token_logprobs": unscored}}, sample, vocab)
    with pytest.raises(TeacherAnswerError, match="no meta_info"):
        teacher_logprobs_from({}, sample, vocab)
