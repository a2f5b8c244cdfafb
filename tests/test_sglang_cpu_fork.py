"""The ``spawn_reimports_sglang`` work-around (megarl/platform/sglang_cpu.py): an engine whose scheduler
and detokenizer are forked from the server process answers exactly as one whose children are spawned
(SGLang's own start method), and its children start on a fraction of the CPU time (they inherit the
imported SGLang instead of importing it again)."""
import httpx
import psutil
import pytest

from megarl.engines.server import EngineSettings, SGLangEngine
from megarl.platform import sglang_cpu

pytestmark = [pytest.mark.processes,
              pytest.mark.skipif(not sglang_cpu.needed(), reason="the work-arounds are inactive on GPU machines")]

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def greedy(engine: SGLangEngine) -> list[dict]:
    """Token ids and their log-probs of eight greedy tokens after each prompt."""
    body = {"input_ids": PROMPTS, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}}
    response = httpx.post(engine.url + "/generate", json=body, timeout=60.0)
    response.raise_for_status()
    return [{"ids": r["output_ids"], "logprobs": [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]}
            for r in response.json()]


def start_up_cpu(engine: SGLangEngine) -> tuple[float, float]:
    """CPU seconds (user + system) of the server process and of its engine children (scheduler,
    detokenizer), read right after the engine turned healthy."""
    server = psutil.Process(engine.pid)
    children = [p for p in server.children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(children) == 2, [p.cmdline() for p in children]
    seconds = [sum(p.cpu_times()[:2]) for p in (server, *children)]
    return seconds[0], sum(seconds[1:])


def test_forked_children_answer_as_spawned_ones_on_a_fraction_of_the_start_up_cpu(tiny_checkpoint, tmp_path,
                                                                                   monkeypatch):
    def run(name: str) -> tuple[tuple[float, float], list[dict]]:
        settings = EngineSettings(model_path=tiny_checkpoint, dtype="float32", max_total_tokens=1024,
                                  log_path=str(tmp_path / f"{name}.log"))
        with SGLangEngine(settings) as engine:
            cpu = start_up_cpu(engine)
            return cpu, greedy(engine)

    (forked_server, forked_children), forked = run("forked")
    monkeypatch.setenv(sglang_cpu.OFF_ENV, "spawn_reimports_sglang")
    (spawned_server, spawned_children), spawned = run("spawned")

    assert forked == spawned
    assert all(len(r["ids"]) == 8 for r in forked)
    # Spawned children import SGLang again: together at least the server's own import (~2x here);
    # forked ones only build the model and the caches.
    assert spawned_children > spawned_server, (spawned_children, spawned_server)
    assert forked_children < 0.5 * spawned_children, (forked_children, spawned_children)
