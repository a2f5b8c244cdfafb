"""The ``spawn_reimports_sglang`` work-around (megarl/platform/sglang_cpu.py): an engine whose scheduler
and detokenizer are forked from the server process answers exactly as one whose children are spawned
(SGLang's own start method), and its children start on a fraction of the CPU time (they inherit the
imported SGLang instead of importing it again). The forked engine is the session's ``tiny_engine``,
whose start-up CPU conftest read when it turned healthy; the spawned one has the same settings."""
import dataclasses

import httpx
import pytest
from engine_start_cpu import start_up_cpu

from megarl.engines.server import SGLangEngine
from megarl.platform import sglang_cpu

pytestmark = [pytest.mark.processes,
              pytest.mark.skipif(not sglang_cpu.needed(), reason="the work-arounds are inactive on GPU machines")]

# ids no other test's prompt starts with: the shared engine's prefix cache holds none of them, so both
# engines prefill these prompts from scratch, in the same batch
PROMPTS = [[301, 302, 303, 304, 305], [307, 308, 309]]


def greedy(engine: SGLangEngine) -> list[dict]:
    """Token ids and their log-probs of eight greedy tokens after each prompt."""
    body = {"input_ids": PROMPTS, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}}
    response = httpx.post(engine.url + "/generate", json=body, timeout=60.0)
    response.raise_for_status()
    return [{"ids": r["output_ids"], "logprobs": [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]}
            for r in response.json()]


def test_forked_children_answer_as_spawned_ones_on_a_fraction_of_the_start_up_cpu(tiny_engine_started, tmp_path,
                                                                                   monkeypatch):
    forked_engine, forked_cpu = tiny_engine_started
    forked = greedy(forked_engine)
    monkeypatch.setenv(sglang_cpu.OFF_ENV, "spawn_reimports_sglang")
    with SGLangEngine(dataclasses.replace(forked_engine.settings, log_path=str(tmp_path / "spawned.log"))) as engine:
        spawned_cpu = start_up_cpu(engine.pid)
        spawned = greedy(engine)

    for cpu in (forked_cpu, spawned_cpu):
        assert len(cpu.children) == 2, cpu.children
    assert forked == spawned
    assert all(len(r["ids"]) == 8 for r in forked)
    # Spawned children import SGLang again: together at least the server's own import (~2x here);
    # forked ones only build the model and the caches.
    assert spawned_cpu.children_s > spawned_cpu.server_s, spawned_cpu
    assert forked_cpu.children_s < 0.5 * spawned_cpu.children_s, (forked_cpu, spawned_cpu)
