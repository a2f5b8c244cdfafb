"""Rewards: rule-based, math-verify, user functions by dotted path, a remote reward model over HTTP,
and the scorer's timeout / error accounting (no engine needed)."""
import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pytest

from megarl.sample import FinishReason, RolloutSample
from megarl.tasks.prompts import Prompt
from megarl.tasks.reward_types import RewardInput
from megarl.tasks.rewards import (
    RemoteRewardModel,
    RewardScorer,
    arithmetic_reward,
    exact_match_reward,
    load_user_reward,
    make_reward,
    math_reward,
)

pytestmark = pytest.mark.unit


def make_input(response: str, answer: str | None = "7", ended: bool = True, prompt: str = "3+4=",
               plain_text: str | None = None) -> RewardInput:
    sample = RolloutSample(prompt_ids=[1], response_ids=[], loss_mask=np.zeros(0, np.uint8),
                           rollout_logprobs=np.zeros(0, np.float32), model_version=np.zeros(0, np.int32),
                           routed_experts=None, sampling_mask=None, finish_reason=FinishReason.STOP)
    return RewardInput(prompt=Prompt(prompt, answer, {"source": "test"}, plain_text), response_text=response,
                       ended=ended, sample=sample)


def run(coro):
    return asyncio.run(coro)


def test_rule_based_rewards():
    assert run(arithmetic_reward(make_input("7"))) == 1.0
    assert run(arithmetic_reward(make_input("7", ended=False))) == 0.0  # cut by the length limit
    assert run(arithmetic_reward(make_input("77"))) == 0.0
    assert run(exact_match_reward(make_input("  Paris \n", answer="Paris"))) == 1.0
    assert run(exact_match_reward(make_input("paris", answer="Paris"))) == 0.0


def test_math_verify_compares_answers_not_strings():
    assert run(math_reward(make_input("so the result is \\boxed{0.5}", answer="\\frac{1}{2}"))) == 1.0
    assert run(math_reward(make_input("The answer is $\\frac{6}{4}$", answer="1.5"))) == 1.0
    assert run(math_reward(make_input("The answer is 3", answer="1.5"))) == 0.0


def test_a_reward_without_an_answer_is_an_error_not_a_crash():
    scorer = RewardScorer(exact_match_reward, timeout_s=5)
    outcome = run(scorer(make_input("x", answer=None)))
    assert outcome.value == 0.0 and outcome.error.startswith("ValueError: the prompt '3+4=' has no answer")


def test_raise_and_timeout_are_counted_and_logged_once_per_kind(caplog):
    async def flaky(inp: RewardInput) -> float:
        if inp.response_text == "boom":
            raise KeyError("no such key")
        if inp.response_text == "slow":
            await asyncio.sleep(10)
        return 1.0

    scorer = RewardScorer(flaky, timeout_s=0.2)

    async def body():
        return await asyncio.gather(*(scorer(make_input(t)) for t in ["ok", "boom", "slow", "boom", "slow", "ok"]))

    with caplog.at_level(logging.WARNING, logger="megarl.tasks.rewards"):
        outcomes = run(body())
    assert [o.value for o in outcomes] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert [o.error.split(":")[0] if o.error else None for o in outcomes] == \
        [None, "KeyError", "timeout", "KeyError", "timeout", None]
    assert scorer.errors == {"KeyError": 2, "timeout": 2}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and sum("KeyError" in w for w in warnings) == 1


def test_a_result_that_is_no_finite_number_is_a_counted_error():
    import numpy as np

    results = {"a": "0.5", "b": None, "c": float("nan"), "d": float("-inf"), "e": np.float32(0.25), "f": True}

    async def odd(inp: RewardInput):
        return results[inp.response_text]

    scorer = RewardScorer(odd, timeout_s=5)
    outcomes = {t: run(scorer(make_input(t))) for t in results}
    assert {t: o.value for t, o in outcomes.items()} == {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 0.25, "f": 1.0}
    assert outcomes["a"].error == "not_a_number: returned str '0.5', not a finite number"
    assert outcomes["c"].error == "not_a_number: returned float 'nan', not a finite number"
    assert scorer.errors == {"not_a_number": 4}


USER_MODULE = '''
import asyncio

def length_reward(inp):
    return float(len(inp.response_text))

async def async_reward(inp):
    await asyncio.sleep(0)
    return 2.5

NOT_A_FUNCTION = 3
'''


def test_user_functions_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run(load_user_reward("my_rewards.length_reward")(make_input("abcd"))) == 4.0
    assert run(load_user_reward("my_rewards:async_reward")(make_input("x"))) == 2.5
    assert run(make_reward(SimpleNamespace(type="function", path="my_rewards.length_reward", url=None))(
        make_input("abc"))) == 3.0
    with pytest.raises(ValueError, match="my_rewards.nothing_here.*AttributeError"):
        load_user_reward("my_rewards.nothing_here")
    with pytest.raises(ValueError, match="no_such_module.f.*ModuleNotFoundError"):
        load_user_reward("no_such_module.f")
    with pytest.raises(ValueError, match="is a int, not a function"):
        load_user_reward("my_rewards.NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="not 'package.module.function'"):
        load_user_reward("length_reward")


class _RewardModelHandler(BaseHTTPRequestHandler):
    """Reward = number of characters of the response; 'fail' answers HTTP 500, 'junk' a non-reward body."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        if body["response"] == "fail":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"model crashed")
            return
        answer = {"score": 1} if body["response"] == "junk" else {"reward": float(len(body["response"]))}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def reward_server():
    _RewardModelHandler.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RewardModelHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/reward", _RewardModelHandler.seen
    server.shutdown()
    server.server_close()


def test_remote_reward_model_over_http(reward_server):
    url, seen = reward_server

    async def body():
        model = make_reward(SimpleNamespace(type="remote", url=url, path=None))
        assert isinstance(model, RemoteRewardModel)
        scorer = RewardScorer(model, timeout_s=10)
        try:
            inputs = [make_input(t) for t in ["hello", "fail", "junk"]]
            inputs.append(make_input("hi", prompt="<|bos|>U:3+4=\nA:", plain_text="3+4="))  # a chat-template rendering
            return await asyncio.gather(*(scorer(inp) for inp in inputs)), scorer
        finally:
            await model.aclose()

    outcomes, scorer = run(body())
    assert [o.value for o in outcomes] == [5.0, 0.0, 0.0, 2.0]
    assert "HTTP 500: model crashed" in outcomes[1].error and "expected {'reward': float}" in outcomes[2].error
    assert scorer.errors == {"RuntimeError": 1, "ValueError": 1}
    assert {"prompt": "3+4=", "response": "hello", "answer": "7", "metadata": {"source": "test"}} in seen
    assert {"prompt": "3+4=", "response": "hi", "answer": "7", "metadata": {"source": "test"}} in seen  # as written


def test_unreachable_reward_model_is_a_counted_error():
    async def body():
        model = RemoteRewardModel("http://127.0.0.1:9/reward")  # discard port: connection refused
        scorer = RewardScorer(model, timeout_s=10)
        try:
            return await scorer(make_input("x")), scorer.errors
        finally:
            await model.aclose()

    outcome, errors = run(body())
    assert outcome.value == 0.0 and errors == {"ConnectError": 1}


def test_reward_config_names_what_is_missing():
    with pytest.raises(ValueError, match="reward.url"):
        make_reward(SimpleNamespace(type="remote", url=None, path=None))
    with pytest.raises(ValueError, match="reward.path"):
        make_reward(SimpleNamespace(type="function", url=None, path=None))
    with pytest.raises(ValueError, match="'bleu' is not one of arithmetic, exact_match, math, remote, function"):
        make_reward(SimpleNamespace(type="bleu", url=None, path=None))
