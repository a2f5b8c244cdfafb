"""Agent episodes in the driver and in agent workers, side by side in one run.

The tool-heavy stand-in agent (``megarl/agents/examples/cpu_tool.py``: one chat call of at most 4 tokens,
then a pure-Python tool spending 200 ms of CPU) runs ``--episodes`` episodes at once through megarl's
gateway on one SGLang engine serving the tiny demo model (CPU), first in the driver's event loop
(``task.agent_workers=0``), then in ``--workers`` agent workers (Ray actors, ``--episodes-per-worker``
episodes each at once), alternately ``--repeats`` times, after a warm-up of each. Per run: episodes a
second (wall clock, all episodes submitted at once to the last one's end) and the driver's CPU seconds
an episode (this process: gateway, Ray client, episodes' bookkeeping). The JSON has the medians per
mode, every run, and ``workers_over_driver`` = the median episodes a second in workers / in the driver.

Usage: python tools/bench/agents.py --json FILE [--episodes N --workers W --episodes-per-worker E
       --repeats R --tool-cpu-s S --work-dir D]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from work_dir import work_directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

AGENT = "megarl.agents.examples.cpu_tool:generate_then_tool"


async def one_run(episodes, count: int, tool_cpu_s: float) -> dict:
    """``count`` episodes of ``episodes`` (an ``AgentEpisodes``) at once: their figures."""
    from megarl.tasks.prompts import Prompt

    prompts = [Prompt(f"{i % 10}+{(i * 7) % 10}=", metadata={"tool_cpu_s": tool_cpu_s}) for i in range(count)]
    cpu, start = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(episodes.run(p, f"g{i}", f"g{i}.0") for i, p in enumerate(prompts)))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    ended = [s.episode_end for samples in results for s in samples]
    if ended != ["done"] * count or episodes.errors:
        raise RuntimeError(f"episodes did not all end done: {sorted(set(ended))}, errors {dict(episodes.errors)}")
    return {"seconds": seconds, "episodes_per_s": count / seconds, "driver_cpu_s_per_episode": cpu / count}


async def bench(engine, tokenizer, args) -> dict:
    """Both modes' runs, alternately, on ``engine``."""
    from megarl.agents.gateway import AgentGateway, GatewaySettings
    from megarl.agents.rollout import AgentEpisodes
    from megarl.agents.spec import load_agent
    from megarl.agents.workers import AgentWorkers
    from megarl.engines.client import SGLangClient
    from megarl.engines.types import GenerationOptions, SamplingParams
    from megarl.parallel.network import node_address

    params = SamplingParams(max_new_tokens=4, top_k=5)
    workers = AgentWorkers(args.workers, cpus=1.0, episodes_per_worker=args.episodes_per_worker)
    runs: dict[str, list[dict]] = {"driver": [], "workers": []}
    async with SGLangClient(engine.url, engine.model) as client:
        def agent_episodes(pool):
            settings = GatewaySettings(max_turns=1, max_response_tokens=8, host=node_address() if pool else "127.0.0.1")
            gateway = AgentGateway(client, tokenizer, GenerationOptions(params), settings)
            return AgentEpisodes(gateway, load_agent(AGENT), timeout_s=600.0, workers=pool)

        modes = {name: agent_episodes(pool) for name, pool in (("driver", None), ("workers", workers))}
        try:
            for episodes in modes.values():  # warm-up: the worker processes, the engine's first requests
                await one_run(episodes, 2 * args.workers, args.tool_cpu_s)
            for r in range(args.repeats):
                for name, episodes in modes.items():
                    runs[name].append(await one_run(episodes, args.episodes, args.tool_cpu_s))
                    print(f"repeat {r}, {name}: {runs[name][-1]['episodes_per_s']:.2f} episodes/s, driver CPU "
                          f"{runs[name][-1]['driver_cpu_s_per_episode'] * 1e3:.1f} ms an episode", flush=True)
        finally:
            for episodes in modes.values():
                await episodes.aclose()
            await workers.aclose()
    medians = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]} | {"runs": rs}
               for name, rs in runs.items()}
    return medians | {"workers_over_driver": medians["workers"]["episodes_per_s"] / medians["driver"]["episodes_per_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--episodes", type=int, default=32, help="episodes of a run, all submitted at once")
    parser.add_argument("--workers", type=int, default=2, help="agent worker processes (one a core here)")
    parser.add_argument("--episodes-per-worker", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tool-cpu-s", type=float, default=0.2, help="CPU seconds the stand-in's tool spends")
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()

    import ray
    from transformers import AutoTokenizer

    from megarl.engines.server import EngineSettings, SGLangEngine
    from megarl.log import setup_logging
    from megarl.models.tiny_moe import make_tiny_moe

    setup_logging()
    work = work_directory(args.work_dir, "megarl-bench-")
    checkpoint = make_tiny_moe(work / "tiny")
    settings = EngineSettings(model_path=str(checkpoint), dtype="float32", max_total_tokens=4096,
                              log_path=str(work / "server.log"))
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    try:
        with SGLangEngine(settings) as engine:
            result = asyncio.run(bench(engine, AutoTokenizer.from_pretrained(checkpoint), args))
    finally:
        ray.shutdown()
    result["workload"] = vars(args) | {"json": None, "agent": AGENT, "cores": os.cpu_count()}
    driver, workers = result["driver"]["episodes_per_s"], result["workers"]["episodes_per_s"]
    print(f"driver {driver:.2f} episodes/s, workers {workers:.2f} episodes/s: workers/driver "
          f"{result['workers_over_driver']:.2f}")
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
