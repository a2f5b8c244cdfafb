"""Start-up of one SGLang engine on the tiny checkpoint: time to healthy, its CPU, and its first requests.

Usage: python tools/bench/engine_start.py --json FILE [--tp 1 2] [--repeats R] [--work-dir D]

For each TP size it starts an engine ``repeats`` times and, for TP > 1, as many times again with the
CPU work-around ``tp_embedding_compiles_at_first_request`` turned off, the two alternating (so a
drift of the machine moves both alike). Each start reports the seconds from ``SGLangEngine.start`` to
a healthy server, the CPU seconds of the server's process tree by then, and the seconds of its first
and second generate request (4 prompts, 8 new tokens). The JSON holds every start and, per TP size,
the medians; for TP > 1 ``first_request_off_over_on``: the first request's median with the work-around
off over on (> 1 means the work-around saves time).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from work_dir import work_directory

WORKAROUND = "tp_embedding_compiles_at_first_request"
BODY = {"input_ids": [[5, 6, 7, 8]] * 4, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}}


def one_start(checkpoint: Path, tp: int, log_path: Path) -> dict[str, float]:
    """Seconds to healthy, CPU seconds of the server's tree then, seconds of the first two requests."""
    import httpx
    import psutil

    from megarl.engines.server import EngineSettings, SGLangEngine

    settings = EngineSettings(model_path=str(checkpoint), dtype="float32", max_total_tokens=2048, tp=tp,
                              mem_fraction_static=0.75, log_path=str(log_path))
    engine = SGLangEngine(settings)
    t0 = time.perf_counter()
    engine.start()
    try:
        figures = {"healthy_s": time.perf_counter() - t0}
        server = psutil.Process(engine.pid)
        figures["cpu_s"] = sum(sum(p.cpu_times()[:2]) for p in (server, *server.children(recursive=True)))
        for name in ("first_request_s", "second_request_s"):
            t0 = time.perf_counter()
            httpx.post(engine.url + "/generate", json=BODY, timeout=300).raise_for_status()
            figures[name] = time.perf_counter() - t0
    finally:
        engine.stop()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()

    from megarl.models.tiny_moe import make_tiny_moe
    from megarl.platform import sglang_cpu

    work = work_directory(args.work_dir, "megarl-bench-")
    checkpoint = make_tiny_moe(work / "tiny_moe")
    result: dict[str, dict] = {}
    for tp in args.tp:
        ways = ("on", "off") if tp > 1 and sglang_cpu.needed() else ("on",)
        starts: dict[str, list[dict]] = {way: [] for way in ways}
        for r in range(args.repeats):
            for way in ways:
                os.environ[sglang_cpu.OFF_ENV] = WORKAROUND if way == "off" else ""
                starts[way].append(one_start(checkpoint, tp, work / f"tp{tp}-{way}-{r}.log"))
                print(f"TP{tp}, {WORKAROUND} {way}, start {r}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in starts[way][-1].items()), flush=True)
        os.environ.pop(sglang_cpu.OFF_ENV, None)
        medians = {way: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for way, runs in starts.items()}
        result[f"tp{tp}"] = {"starts": starts, "medians": medians}
        print(f"TP{tp} medians: {json.dumps(medians)}")
        if "off" in medians:
            ratio = medians["off"]["first_request_s"] / medians["on"]["first_request_s"]
            result[f"tp{tp}"]["first_request_off_over_on"] = ratio
            print(f"TP{tp} first request, {WORKAROUND} off over on: {ratio:.2f}")
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
