"""A new weight version lets the producer's waiting groups reach their engine before the driver's
step goes on: by the time ``set_engine_version`` returns, on the run's loop (eager tasks), the joint
``/generate`` request of the groups it released has been sent, through the real rollout, pool and
client layers (the engine is an httpx mock transport that records the request and never answers)."""
import asyncio
import contextlib
import json

import httpx
import pytest

from megarl.engines.client import SGLangClient
from megarl.engines.pool import EnginePool
from megarl.engines.types import GenerationOptions, SamplingParams, ServedModel
from megarl.pipeline.buffer import RolloutBuffer
from megarl.pipeline.ledger import Ledger
from megarl.pipeline.producer import ProducerStart, Production, RolloutProducer
from megarl.pipeline.run import start_tasks_eagerly
from megarl.rollout.group import RolloutManager
from megarl.tasks.prompts import Prompt
from megarl.tasks.rewards import RewardScorer

pytestmark = pytest.mark.unit

GROUPS, SAMPLES = 3, 2


class Prompts:
    def __init__(self):
        self.position = 0

    def next_batch(self, n):
        self.position += n
        return [Prompt(text=f"{self.position - n + i} + 1 =") for i in range(n)]

    def state_dict(self):
        return {"position": self.position}


def tokenize(text, add_special_tokens=True):
    return {"input_ids": [ord(c) % 100 for c in text]}


async def released_requests(eager: bool) -> list[dict]:
    """The /generate payloads sent by the time ``set_engine_version(0)`` returns, the producer having
    waited for version 0 to start its first batch."""
    sent: list[dict] = []
    never = asyncio.Event()

    async def engine(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        await never.wait()

    client = SGLangClient("http://engine", ServedModel(vocab_size=100, num_layers=2, topk=2, num_experts=8,
                                                       context_length=64))
    await client._http.aclose()
    client._http = httpx.AsyncClient(base_url="http://engine", transport=httpx.MockTransport(engine))
    manager = RolloutManager(EnginePool([client]), tokenize, scorer=RewardScorer(lambda *a: 0.0),
                             generation=GenerationOptions(SamplingParams(max_new_tokens=2, top_k=5)),
                             samples_per_prompt=SAMPLES)
    ledger = Ledger()
    buffer = RolloutBuffer(capacity=GROUPS, max_staleness=0, ledger=ledger)
    async with contextlib.AsyncExitStack() as stack:
        if eager:
            start_tasks_eagerly(stack)
        production = Production(prompts_per_step=GROUPS, samples_per_prompt=SAMPLES, lag=0, dynamic_sampling=False)
        start = ProducerStart(engine_version=-1)
        producer = RolloutProducer(manager, Prompts(), buffer, ledger, production, start)
        task = asyncio.create_task(producer.run())
        for _ in range(20):
            await asyncio.sleep(0)
        assert sent == [] and ledger.prompts.started == 0  # the first batch waits for version 0
        await producer.set_engine_version(0)
        released = list(sent)
        task.cancel()
        await producer.stop()
        await client.aclose()
    return released


def test_the_groups_a_version_releases_are_sent_before_set_engine_version_returns():
    released = asyncio.run(released_requests(eager=True))
    assert [len(r["input_ids"]) for r in released] == [GROUPS * SAMPLES]  # one joint request, every group


def test_without_eager_tasks_the_groups_are_still_on_their_way():
    """The hops a group's request takes (group task, the pool's placement, the engine call, the joint
    request) each cost a loop turn with ordinary tasks: what eager tasks save."""
    assert asyncio.run(released_requests(eager=False)) == []
