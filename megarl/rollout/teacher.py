"""On-policy distillation's teacher: an SGLang engine serving ``teacher.hf_path`` scores the student's
own samples.

Each sample is one prefill request: ``input_ids`` = prompt + response (T = P + R tokens),
``max_new_tokens`` 0, ``return_logprob`` with ``logprob_start_len`` = P - 1. SGLang returns
``meta_info.input_token_logprobs`` for the tokens from that position on, ``[log-prob, token id,
None]`` each, where the first one has log-prob None (SGLang scores no token at the start position,
as at position 0), so starting one token before the response gives the R + 1 entries whose last R
are ``log p_teacher(token P+i | tokens before it)``, i = 0..R-1 (slime's scorer,
``slime/rollout/on_policy_distillation.py``, asks from position 0 and trims ``input_token_logprobs``
to the response). The samples of a group go to the engine as one HTTP request, which SGLang splits
into one prefill per sample and schedules together.

Temperature: none is applied, and none should be. SGLang computes input log-probs as the
log-softmax of the raw logits over the whole vocabulary (``sglang/srt/layers/logprob_processor.py``,
``InputLogprobProcessor``); a request's temperature, top-k and top-p shape only the tokens it
samples, and a prefill-only request samples none. So ``teacher_logprobs`` are the teacher's own
distribution at temperature 1 and full vocabulary: the target the student's reverse KL is taken to
(:mod:`megarl.algos.distill`). Sending temperature 1 anyway keeps the request meaningful should an
engine apply it.

Failures are counted, never fatal: a teacher that cannot be reached, answers an HTTP error, takes
longer than ``timeout_s``, or returns log-probs that do not match the response (wrong count or
token ids) marks the affected samples ``finish_reason`` error (their group's ledger counts them as
error and they are not trained); :attr:`TeacherScorer.errors` counts them by kind.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence

import httpx
import numpy as np

from megarl.engines.client import auth_headers, engine_limits
from megarl.sample import FinishReason, RolloutSample

log = logging.getLogger(__name__)


class TeacherAnswerError(ValueError):
    """The teacher's answer for a sample does not hold one log-prob per response token."""


def reported_ids(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The ids SGLang 0.5.23 reports beside input log-probs: the last vocabulary id ``vocab_size - 1``
    comes back as 0 (``scheduler_components/logprob_result_processor.py`` clips ids ``>= vocab_size - 1``,
    meant for image-token hashes); its log-prob is that of the real token."""
    return [t if t < vocab_size - 1 else 0 for t in token_ids]


def teacher_logprobs_from(out: dict, sample: RolloutSample, vocab_size: int) -> np.ndarray:
    """float32 [R]: the response tokens' log-probs in one ``/generate`` answer of a prefill request
    with ``logprob_start_len`` = P - 1 to an engine of ``vocab_size`` ids; raises
    :class:`TeacherAnswerError` when they do not line up with the response."""
    try:
        entries = out["meta_info"]["input_token_logprobs"][1:]  # the first: the last prompt token, unscored
    except (KeyError, TypeError):
        raise TeacherAnswerError("the answer has no meta_info.input_token_logprobs") from None
    ids = [e[1] for e in entries]
    if ids != reported_ids(sample.response_ids, vocab_size):
        raise TeacherAnswerError(f"input_token_logprobs cover tokens {ids[:8]}, not the {len(sample.response_ids)} "
                                 f"response tokens {list(sample.response_ids[:8])}")
    values = np.asarray([np.nan if e[0] is None else e[0] for e in entries], dtype=np.float32)
    if not np.isfinite(values).all():
        raise TeacherAnswerError("input_token_logprobs holds a non-finite log-prob")
    return values


class TeacherScorer:
    """Fills ``teacher_logprobs`` float32 [R] from the teacher engine at ``base_url``, which serves a
    checkpoint of ``vocab_size`` ids (the student's).

    ``api_key``: the engine's ``--api-key`` (None: none). ``timeout_s``: the most one scoring
    request may take, connection included. ``errors``: samples marked error, by kind (unreachable,
    timeout, http_<status>, malformed), over the scorer's life. Use from one event loop.
    """

    def __init__(self, base_url: str, vocab_size: int, *, api_key: str | None = None, timeout_s: float = 60.0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.base_url, self.vocab_size, self.timeout_s = base_url, vocab_size, timeout_s
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=auth_headers(api_key),
                                       limits=engine_limits())
        self.errors: collections.Counter[str] = collections.Counter()

    async def aclose(self) -> None:
        await self._http.aclose()

    def metrics(self) -> dict[str, float]:
        """``distill/teacher_errors``: samples the teacher failed to score so far."""
        return {"distill/teacher_errors": float(sum(self.errors.values()))}

    async def score(self, samples: Sequence[RolloutSample]) -> int:
        """Score every sample (one request for all of them); returns how many it marked error.

        A sample without response tokens gets an empty array without a request."""
        for sample in samples:
            if not sample.response_ids:
                sample.teacher_logprobs = np.zeros(0, np.float32)
        todo = [s for s in samples if s.response_ids]
        if not todo:
            return 0
        payload = {"input_ids": [list(s.prompt_ids) + list(s.response_ids) for s in todo],
                   "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                   "return_logprob": True, "logprob_start_len": [len(s.prompt_ids) - 1 for s in todo]}
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self._http.post("/generate", json=payload)
        except (TimeoutError, httpx.TimeoutException):
            return self._fail(todo, "timeout", f"no answer within {self.timeout_s:g} s")
        except httpx.TransportError as exc:
            return self._fail(todo, "unreachable", f"{type(exc).__name__}: {exc}")
        if response.status_code != 200:
            return self._fail(todo, f"http_{response.status_code}", response.text[:200])
        outs = response.json()
        if not isinstance(outs, list) or len(outs) != len(todo):
            return self._fail(todo, "malformed", f"expected a list of {len(todo)} answers")
        failed = 0
        for sample, out in zip(todo, outs):
            try:
                sample.teacher_logprobs = teacher_logprobs_from(out, sample, self.vocab_size)
            except TeacherAnswerError as exc:
                failed += self._fail([sample], "malformed", str(exc))
        return failed

    def _fail(self, samples: list[RolloutSample], kind: str, why: str) -> int:
        if not self.errors[kind]:
            log.warning("teacher at %s could not score %d samples (%s: %s); they are errors (logged once per kind, "
                        "counted in distill/teacher_errors)", self.base_url, len(samples), kind, why)
        self.errors[kind] += len(samples)
        for sample in samples:
            sample.finish_reason = FinishReason.ERROR
            sample.teacher_logprobs = None
        return len(samples)
