"""Concurrent generate_batch calls joined into one request (megarl/engines/coalesce.py): first with a
recording stand-in for the client's one-request path (what is joined, split and retried), then on the
shared SGLang engine (one HTTP request for the calls of one turn, each caller's greedy samples equal
to its own request's, and an engine rejection reaching only the call it belongs to)."""
import asyncio

import httpx
import pytest

from megarl.engines.client import SGLangClient
from megarl.engines.coalesce import BatchCoalescer
from megarl.engines.types import EngineError, EngineUnreachable, SamplingParams


class Recorder:
    """``send``: answers each prompt with ``(prompt, group_id)``; fails a request holding ``bad``."""

    def __init__(self, bad=None, error=ValueError):
        self.requests, self.bad, self.error = [], bad, error

    async def send(self, prompts, group_ids, key):
        self.requests.append((list(prompts), key))
        await asyncio.sleep(0.01)
        if self.bad in prompts:
            raise self.error(f"bad prompt {self.bad}")
        return [(p, g) for p, g in zip(prompts, group_ids)]


def run(coro):
    return asyncio.run(coro)


@pytest.mark.unit
def test_the_calls_of_one_turn_go_as_one_request_and_come_back_split_in_order():
    recorder = Recorder()
    coalescer = BatchCoalescer(recorder.send, isolate=lambda e: True)

    async def main():
        calls = [coalescer.submit([[i, 0], [i, 1]], [f"g{i}", f"g{i}"], "k") for i in range(5)]
        return await asyncio.gather(*calls)

    answers = run(main())
    assert len(recorder.requests) == 1 and len(recorder.requests[0][0]) == 10
    assert answers == [[([i, 0], f"g{i}"), ([i, 1], f"g{i}")] for i in range(5)]


@pytest.mark.unit
def test_different_keys_and_later_turns_are_separate_requests():
    recorder = Recorder()
    coalescer = BatchCoalescer(recorder.send, isolate=lambda e: True)

    async def main():
        first = await asyncio.gather(coalescer.submit([[1]], ["a"], "k1"), coalescer.submit([[2]], ["b"], "k2"))
        second = await coalescer.submit([[3]], ["c"], "k1")  # a later turn: its own request
        return first, second

    first, second = run(main())
    assert sorted(key for _, key in recorder.requests) == ["k1", "k1", "k2"]
    assert first == [[([1], "a")], [([2], "b")]] and second == [([3], "c")]


@pytest.mark.unit
def test_a_rejected_joint_request_is_retried_call_by_call():
    recorder = Recorder(bad=[7])
    coalescer = BatchCoalescer(recorder.send, isolate=lambda e: isinstance(e, ValueError))

    async def main():
        return await asyncio.gather(coalescer.submit([[1], [2]], ["a", "a"], "k"), coalescer.submit([[7]], ["b"], "k"),
                                    coalescer.submit([[3]], ["c"], "k"), return_exceptions=True)

    good, bad, other = run(main())
    assert good == [([1], "a"), ([2], "a")] and other == [([3], "c")]
    assert isinstance(bad, ValueError) and "bad prompt [7]" in str(bad)
    assert [len(prompts) for prompts, _ in recorder.requests] == [4, 2, 1, 1]  # joint, then each alone


@pytest.mark.unit
def test_an_error_of_the_whole_request_fails_every_call_once():
    recorder = Recorder(bad=[7], error=ConnectionError)
    coalescer = BatchCoalescer(recorder.send, isolate=lambda e: isinstance(e, ValueError))

    async def main():
        return await asyncio.gather(coalescer.submit([[1]], ["a"], "k"), coalescer.submit([[7]], ["b"], "k"),
                                    return_exceptions=True)

    assert all(isinstance(e, ConnectionError) for e in run(main()))
    assert len(recorder.requests) == 1  # not retried: the caller (the engine pool) resubmits


@pytest.mark.unit
def test_a_cancelled_caller_leaves_the_others_their_answers():
    recorder = Recorder()
    coalescer = BatchCoalescer(recorder.send, isolate=lambda e: True)

    async def main():
        leaving = asyncio.ensure_future(coalescer.submit([[1]], ["a"], "k"))
        staying = asyncio.ensure_future(coalescer.submit([[2]], ["b"], "k"))
        await asyncio.sleep(0)  # both submitted, the joint request sent
        leaving.cancel()
        return await staying, leaving

    answer, leaving = run(main())
    assert answer == [([2], "b")] and leaving.cancelled()


# --- on the shared engine ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(p) for p in ("3+4=", "1+8=", "6+2=", "9+9=")]


def test_concurrent_calls_are_one_request_with_each_callers_own_samples(engine, prompts):
    params = SamplingParams(max_new_tokens=4, temperature=0.0, top_k=1)

    async def main():
        async with SGLangClient(engine.url, engine.model) as client:
            alone = [await client.generate_batch([p, p], params, group_ids=[str(i)] * 2) for i, p in enumerate(prompts)]
            sent = []

            async def count(request: httpx.Request):
                if request.url.path == "/generate":
                    sent.append(request)

            client._http.event_hooks["request"] = [count]
            joint = await asyncio.gather(*(client.generate_batch([p, p], params, group_ids=[str(i)] * 2)
                                           for i, p in enumerate(prompts)))
            return alone, joint, sent

    alone, joint, sent = run(main())
    assert len(sent) == 1
    for i, (mine, theirs) in enumerate(zip(joint, alone)):
        assert [s.group_id for s in mine] == [str(i)] * 2
        assert [s.response_ids for s in mine] == [s.response_ids for s in theirs]
        assert [s.routed_experts.tolist() for s in mine] == [s.routed_experts.tolist() for s in theirs]


def test_a_prompt_the_engine_rejects_fails_only_its_own_call(engine, prompts):
    params = SamplingParams(max_new_tokens=2, top_k=5)
    too_long = prompts[0] * engine.model.context_length

    async def main():
        async with SGLangClient(engine.url, engine.model) as client:
            return await asyncio.gather(client.generate_batch([prompts[1]], params, group_ids=["ok"]),
                                        client.generate_batch([too_long], params, group_ids=["long"]),
                                        client.generate_batch([prompts[2]], params, group_ids=["ok2"]),
                                        return_exceptions=True)

    ok, rejected, ok2 = run(main())
    assert isinstance(rejected, EngineError) and not isinstance(rejected, EngineUnreachable), rejected
    assert [s.group_id for s in ok] == ["ok"] and [s.group_id for s in ok2] == ["ok2"]
    assert len(ok[0].response_ids) >= 1 and len(ok2[0].response_ids) >= 1
