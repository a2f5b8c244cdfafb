"""Rewards: rule-based (arithmetic, exact match, math answers via ``math-verify``), a remote reward
model over HTTP, and user functions given by dotted path; all awaited with a timeout.

A reward function is ``async fn(RewardInput) -> float`` (user functions may also be plain
functions; they run in a worker thread). :class:`RewardScorer` applies the timeout and turns a
raise, a timeout or a result that is no finite number (``not_a_number``: a string, None, NaN) into
a :class:`RewardOutcome` with ``error`` set: the caller marks that sample ``FinishReason.ERROR`` with
reward 0.0. Errors are counted per kind and each kind is logged once, so a broken reward never kills
the run nor floods the log.
"""
from __future__ import annotations

import asyncio
import collections
import importlib
import inspect
import logging
import math
from dataclasses import dataclass

import httpx

from megarl.tasks import arithmetic
from megarl.tasks.judge import JudgeReward, with_judge
from megarl.tasks.reward_types import RewardFn, RewardInput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardOutcome:
    """A reward value, or the error that replaced it (then ``value`` is 0.0)."""

    value: float
    error: str | None = None  # "<kind>: <message>", kind = "timeout" or the exception's class name


def _require_answer(inp: RewardInput) -> str:
    if inp.prompt.answer is None:
        raise ValueError(f"the prompt {inp.prompt.plain_text[:60]!r} has no answer to compare against")
    return inp.prompt.answer


async def arithmetic_reward(inp: RewardInput) -> float:
    """The demo task: 1.0 for exactly the answer followed by end-of-sequence."""
    return arithmetic.reward(inp.response_text, _require_answer(inp), inp.ended)


async def exact_match_reward(inp: RewardInput) -> float:
    """1.0 when the response equals the answer after stripping surrounding whitespace."""
    return 1.0 if inp.response_text.strip() == _require_answer(inp).strip() else 0.0


def _math_verify(answer: str, response: str) -> bool:
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM (main thread only); RewardScorer bounds the wait instead.
    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$", parsing_timeout=None)
    return bool(verify(gold, parse(response, parsing_timeout=None), timeout_seconds=None))


async def math_reward(inp: RewardInput) -> float:
    """1.0 when ``math-verify`` finds the response's final answer equal to the reference answer
    (LaTeX, boxed, plain numbers and expressions). Runs in a worker thread: a pathological input
    that exceeds the scorer's timeout is abandoned (the thread finishes in the background)."""
    return 1.0 if await asyncio.to_thread(_math_verify, _require_answer(inp), inp.response_text) else 0.0


def check_reward_url(url: str) -> None:
    """Raise ValueError naming ``reward.url`` unless ``url`` is an absolute http(s) URL."""
    try:
        parsed = httpx.URL(url)
    except Exception as e:  # noqa: BLE001 -- httpx raises several types for a malformed URL
        raise ValueError(f"reward.url: {url!r} is not a URL ({type(e).__name__}: {e})") from e
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"reward.url: {url!r} is not an http(s) URL with a host (e.g. http://host:8000/reward)")


class RemoteRewardModel:
    """A reward model behind HTTP: POST ``url`` with JSON ``{"prompt", "response", "answer",
    "metadata"}`` (``prompt``: ``Prompt.plain_text``, without the policy's chat template), answered by
    JSON ``{"reward": float}``. Any other answer raises (-> error)."""

    def __init__(self, url: str):
        self.url = url
        self._http = httpx.AsyncClient(timeout=None)  # RewardScorer owns the timeout

    async def __call__(self, inp: RewardInput) -> float:
        payload = {"prompt": inp.prompt.plain_text, "response": inp.response_text, "answer": inp.prompt.answer,
                   "metadata": dict(inp.prompt.metadata)}
        response = await self._http.post(self.url, json=payload)
        if response.status_code != 200:
            raise RuntimeError(f"reward model {self.url}: HTTP {response.status_code}: {response.text[:200]}")
        body = response.json()
        if not isinstance(body, dict) or not isinstance(body.get("reward"), (int, float)):
            raise ValueError(f"reward model {self.url} answered {str(body)[:200]}, expected {{'reward': float}}")
        return float(body["reward"])

    async def aclose(self) -> None:
        await self._http.aclose()


def load_user_reward(dotted_path: str) -> RewardFn:
    """The function at ``package.module.function`` (or ``package.module:function``), taking a
    :class:`RewardInput` and returning a float or an awaitable float; plain functions run in a thread."""
    module_name, sep, attr = dotted_path.rpartition(":") if ":" in dotted_path else dotted_path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward.path: {dotted_path!r} is not 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 -- a user module can fail to import in any way
        raise ValueError(f"reward.path: {dotted_path!r} does not import: {type(e).__name__}: {e}") from e
    try:
        fn = getattr(module, attr)
    except AttributeError as e:
        raise ValueError(f"reward.path: {dotted_path!r}: AttributeError: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward.path: {dotted_path!r} is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn):
        return fn

    async def call(inp: RewardInput) -> float:
        value = await asyncio.to_thread(fn, inp)
        return await value if inspect.isawaitable(value) else value

    call.__name__ = attr
    return call


BUILT_IN = {"arithmetic": arithmetic_reward, "exact_match": exact_match_reward, "math": math_reward}
REWARD_TYPES = (*BUILT_IN, "remote", "function")


def make_reward(reward_cfg, judge: JudgeReward | None = None) -> RewardFn:
    """The reward a ``RewardConfig`` (``cfg.reward``) names: ``type`` arithmetic | exact_match |
    math | remote (``url``) | function (``path``). With ``reward.judge.hf_path`` set, ``judge`` is the
    judge on its engine (``megarl.pipeline.judge.make_judge``) and the reward is ``rule_weight *
    rule + judge.weight * judge`` (:func:`megarl.tasks.judge.with_judge`)."""
    rule = _rule_reward(reward_cfg)
    if not getattr(getattr(reward_cfg, "judge", None), "hf_path", None):  # no judge section: no judge
        if judge is not None:
            raise ValueError("make_reward: a judge was passed but reward.judge.hf_path is not set")
        return rule
    if judge is None:
        raise ValueError("reward.judge.hf_path: a judge is configured; start its engine and pass "
                         "make_reward(cfg.reward, judge=...)")
    return with_judge(rule, reward_cfg.rule_weight, judge)


def _rule_reward(reward_cfg) -> RewardFn:
    kind = reward_cfg.type
    if kind in BUILT_IN:
        return BUILT_IN[kind]
    if kind == "remote":
        if not reward_cfg.url:
            raise ValueError("reward.url: reward type remote needs the reward model's URL")
        check_reward_url(reward_cfg.url)
        return RemoteRewardModel(reward_cfg.url)
    if kind == "function":
        if not reward_cfg.path:
            raise ValueError("reward.path: reward type function needs 'package.module.function'")
        return load_user_reward(reward_cfg.path)
    raise ValueError(f"reward.type: {kind!r} is not one of {', '.join(REWARD_TYPES)}")


def _finite_number(raw) -> float | None:
    """A reward function's result as a float: a number (python, numpy, a one-element tensor) that is finite;
    None for anything else (a string, None, NaN, an infinity)."""
    if isinstance(raw, (str, bytes)):
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class RewardScorer:
    """Awaits a reward function with a timeout; never raises for the function's failures.

    ``errors`` counts failures by kind (``"timeout"`` or the exception's class name); the first
    failure of each kind is logged with its message, later ones only counted.
    """

    def __init__(self, fn: RewardFn, timeout_s: float = 30.0):
        if timeout_s <= 0:
            raise ValueError(f"reward timeout must be > 0 s, got {timeout_s}")
        self.fn, self.timeout_s = fn, timeout_s
        self.errors: collections.Counter[str] = collections.Counter()

    async def __call__(self, inp: RewardInput) -> RewardOutcome:
        try:
            raw = await asyncio.wait_for(self.fn(inp), self.timeout_s)
        except asyncio.TimeoutError:
            return self._failed("timeout", f"no reward within {self.timeout_s:g} s")
        except Exception as e:  # noqa: BLE001 -- any failure of user code becomes a counted error
            return self._failed(type(e).__name__, str(e))
        value = _finite_number(raw)
        if value is None:
            return self._failed("not_a_number", f"returned {type(raw).__name__} {str(raw)[:60]!r}, not a finite number")
        return RewardOutcome(value)

    def _failed(self, kind: str, message: str) -> RewardOutcome:
        self.errors[kind] += 1
        if self.errors[kind] == 1:
            log.warning("reward %s failed (%s: %s); such samples get reward 0 and finish_reason error "
                        "(logged once per kind, counted in errors)", getattr(self.fn, "__name__", self.fn),
                        kind, message)
        return RewardOutcome(0.0, f"{kind}: {message}")
