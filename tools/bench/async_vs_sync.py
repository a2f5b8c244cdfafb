"""Async vs sync RL on a long-tailed workload and on the demo's, side by side in one run, with the
engine and the trainer pinned to different cores: the disaggregated case async models (generation and
training on hardware of their own), so that the comparison shows overlap and not core sharing.

Pinning (the same in both modes): the SGLang server (its HTTP/tokenizer process, scheduler and
detokenizer) runs on ``--engine-cpus``, the trainer rank (``ray::TrainerRank``) on
``--trainer-cpus``; the driver and Ray's own processes stay unpinned. The bench asks SGLang for the
binding (``SGLANG_CPU_OMP_THREADS_BIND`` = the engine's cores, honoured where SGLang's CPU
binding is available: the sgl-kernel AMX backend or arm64) and, since it is not available on
megarl's CPU path, also sets the CPU affinity of every thread of those processes itself
(``sched_setaffinity``, re-applied every ``PIN_INTERVAL_S`` so late threads and restarted processes
are caught). Each process gets one torch/OpenMP thread per core it is given (``OMP_NUM_THREADS``;
the trainer rank sets 1 itself).

Two workloads, each run ``--repeats`` times as a sync run then an async run (figures: the medians):

  long_tail  the warmed-up tiny model ends most answers after 2-3 tokens, and every ``--long-every``-th
             request the driver sends (a tenth by default) asks SGLang to ignore the end-of-sequence
             token, so it runs to ``--max-new-tokens`` (48 of the model's 64-token context): the few
             long answers that hold a synchronous rollout up. Six optimizer steps per RL step
             (``trainer.updates_per_step=6``, PPO mini-batches as slime's ``--num-steps-per-rollout``)
             at an RL learning rate (``--lr``, 1e-7) that keeps the policy where the warm-up left it,
             so both modes generate the same length distribution and the ratio compares pipelines.
  demo       the demo recipe's own step: answers of at most 3 tokens, one update at the recipe's lr.

Both modes of a workload train the same number of steps on the same number of samples from the same
checkpoint. The figures cover the steady state: the first ``--skip-steps`` steps of each run
(engine and trainer warming up, the async pipeline filling) are left out, and the rest are timed by
the wall clock between the metrics rows of the last skipped and the last step:

  tokens/s            generated response tokens of the counted steps' trained samples / their seconds
  trainer idle frac   seconds the trainer waited for data in the counted steps / their seconds
  overlap_bound       what perfect overlap would give over the sync run: (rollout_s + train_s) /
                      max(rollout_s, train_s), rollout_s the sync trainer's mean wait for its rollout,
                      train_s its mean training + weight-sync seconds a step
  async_over_bound    async's speed-up over sync in steps/s / overlap_bound (1.0: perfect overlap)
  paused_bound        what perfect overlap would give if the engines generate nothing during a weight
                      sync, as SGLang requires (it loads weights only into a paused engine): the sync is
                      then on both paths, (rollout_s + train_s + sync_s) / (max(rollout_s, train_s) +
                      sync_s), train_s here without the sync; at most overlap_bound
  async_over_paused   async's speed-up / paused_bound (1.0: nothing lost beyond the engines' pause)
  machine_busy_MODE   the share of the machine's cores busy (every process: driver and Ray too) over the
                      counted steps of the sync or async run: near 1.0 a run is bound by the machine's
                      CPU, so no overlap makes it faster
  cpu_ceiling         the speed-up over sync at which the async run's CPU seconds a step (every process)
                      would keep every core of the machine busy: sync step_s / (async step_s x
                      machine_busy_async); no schedule of that work on this machine goes faster
  ceiling_over_bound  cpu_ceiling / overlap_bound: below 1.0 the machine's cores end async's speed-up
                      before perfect overlap would, and async_over_bound cannot pass this figure
  engine_busy_MODE    the same share of the engine's cores used by the SGLang server's processes, and
  trainer_busy_MODE   of the trainer's cores by the trainer rank (pinned roles only)

The per-sample length distribution (p50, p90, max, the fraction at the maximum) is recorded from the
trained batches of each run.

Usage: python tools/bench/async_vs_sync.py --json FILE [--steps N --prompts P --samples G ...]
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from demo_workload import add_workload_arguments, workload_overrides
from work_dir import work_directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PIN_INTERVAL_S = 0.25
BOUND_GOAL = 0.9  # async's speed-up over sync should reach this share of perfect overlap's (overlap_bound)


def cpu_list(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``."""
    cpus = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        cpus += range(int(a), int(b or a) + 1)
    return cpus


class CorePinner(threading.Thread):
    """Pins the descendants of this process by role, every thread of each, until stopped; keeps the
    CPU seconds each role used (the last value seen of every process), and after each pass
    (wall-clock time, {role: CPU seconds so far}) in ``history``, with the whole machine's busy CPU
    seconds (every process, the driver and Ray's included) as role ``machine``."""

    def __init__(self, roles: dict[str, list[int]]):
        super().__init__(name="core-pinner", daemon=True)
        self.roles = {role: set(cpus) for role, cpus in roles.items()}
        self._halt = threading.Event()
        self.pids: dict[str, set[int]] = {role: set() for role in roles}
        self._cpu_s: dict[int, float] = {}
        self.history: list[tuple[float, dict[str, float]]] = []

    def run(self) -> None:
        while not self._halt.wait(PIN_INTERVAL_S):
            self.pin_once()

    def stop(self) -> dict:
        self._halt.set()
        self.join()
        return {role: {"cpus": sorted(self.roles[role]), "processes": len(pids),
                       "cpu_s": round(sum(self._cpu_s.get(p, 0.0) for p in pids), 1)}
                for role, pids in self.pids.items()}

    def _members(self) -> dict[str, list]:
        import psutil

        members = {role: [] for role in self.roles}
        for proc in psutil.Process().children(recursive=True):
            try:
                cmdline = " ".join(proc.cmdline())
                if "engine" in members and "megarl.engine_process.sglang_main" in cmdline:
                    members["engine"] += [proc, *proc.children(recursive=True)]
                elif "trainer" in members and "TrainerRank" in cmdline:
                    members["trainer"].append(proc)
            except psutil.Error:
                continue
        return members

    def pin_once(self) -> None:
        import psutil

        for role, procs in self._members().items():
            cpus = self.roles[role]
            for proc in procs:
                try:
                    for tid in os.listdir(f"/proc/{proc.pid}/task"):
                        if os.sched_getaffinity(int(tid)) != cpus:
                            os.sched_setaffinity(int(tid), cpus)
                    times = proc.cpu_times()
                    self._cpu_s[proc.pid] = times.user + times.system
                    self.pids[role].add(proc.pid)
                except (OSError, psutil.Error):
                    continue  # the thread or process ended meanwhile
        machine = psutil.cpu_times()
        self.history.append((time.time(), {"machine": sum(machine) - machine.idle - machine.iowait,
                                           **{role: sum(self._cpu_s.get(p, 0.0) for p in pids)
                                              for role, pids in self.pids.items()}}))

    def busy(self, start: float, end: float) -> dict[str, float]:
        """Role -> the share of its cores' time it used between wall-clock ``start`` and ``end`` (between
        the first and the last pass inside them): 1.0 when its cores never idled. ValueError when fewer
        than two passes fall inside (a window shorter than about two ``PIN_INTERVAL_S``)."""
        import psutil

        times = [t for t, _ in self.history]
        i, j = bisect.bisect_left(times, start), bisect.bisect_right(times, end) - 1
        if j <= i:
            raise ValueError(f"the counted steps ({end - start:.2f} s) span under two CPU samples "
                             f"{PIN_INTERVAL_S:g} s apart: run more --steps")
        (t0, first), (t1, last) = self.history[i], self.history[j]
        cores = {"machine": psutil.cpu_count(), **{role: len(cpus) for role, cpus in self.roles.items()}}
        return {role: round((last[role] - first.get(role, 0.0)) / (cores[role] * (t1 - t0)), 3) for role in last}


class LengthRecorder:
    """Every trained sample's response length, per step (wraps ``fill_advantages``, called once a step)."""

    def __init__(self):
        from megarl.algos import advantages

        self.steps: list[list[int]] = []
        self._module, self._fill = advantages, advantages.fill_advantages

        def fill_advantages(samples, *args, **kwargs):
            self.steps.append([len(s.response_ids) for s in samples])
            return self._fill(samples, *args, **kwargs)

        advantages.fill_advantages = fill_advantages

    def close(self) -> None:
        self._module.fill_advantages = self._fill


class LongTail:
    """Every ``every``-th sample the driver asks an engine for is sent with ``ignore_eos`` and so runs
    to ``max_new_tokens`` (wraps ``SGLangClient._post``: a batch's ``sampling_params`` become one
    dict per prompt); the others end when the model ends them."""

    def __init__(self, every: int):
        from megarl.engines.client import SGLangClient

        self.every, self.requests = every, 0
        self._post = SGLangClient._post
        post = self._post

        async def _post(client, path, payload):
            ids = payload.get("input_ids") if path == "/generate" else None
            if every > 0 and ids:
                batched = isinstance(ids[0], list)
                params = [self._params(payload["sampling_params"]) for _ in (ids if batched else [ids])]
                payload = {**payload, "sampling_params": params if batched else params[0]}
            return await post(client, path, payload)

        SGLangClient._post = _post

    def _params(self, params: dict) -> dict:
        self.requests += 1
        return {**params, "ignore_eos": True} if self.requests % self.every == 0 else params

    def close(self) -> None:
        from megarl.engines.client import SGLangClient

        SGLangClient._post = self._post


def length_figures(lengths: list[int], max_new_tokens: int) -> dict:
    ordered = sorted(lengths)
    return {"samples": len(ordered), "mean": statistics.fmean(ordered), "p50": ordered[len(ordered) // 2],
            "p90": ordered[int(0.9 * (len(ordered) - 1))], "max": ordered[-1],
            "frac_at_max": sum(n >= max_new_tokens for n in ordered) / len(ordered)}


def loop_figures(run_dir: Path, skip: int, lengths: list[list[int]], max_new_tokens: int) -> dict:
    """The steady state of one run: the steps after the first ``skip``, timed by the wall clock."""
    from megarl.metrics.sink import read_metrics

    rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    if len(rows) != len(lengths) or len(rows) <= skip + 1:
        raise RuntimeError(f"{run_dir}: {len(rows)} RL rows, {len(lengths)} recorded batches, {skip} to skip")
    counted, counted_lengths = rows[skip:], [n for step in lengths[skip:] for n in step]
    start = rows[skip - 1]["time"] if skip else counted[0]["time"]
    seconds = counted[-1]["time"] - start
    if not skip:  # no earlier row to time the first step from: count it as its own parts
        seconds += counted[0]["time/wait_s"] + counted[0]["time/train_s"] + counted[0]["sync/seconds"]
    waited = sum(r["time/wait_s"] for r in counted)
    tokens = sum(counted_lengths)
    mean = {k: statistics.fmean(r[key] for r in counted)
            for k, key in (("wait_s", "time/wait_s"), ("train_s", "time/train_s"), ("sync_s", "sync/seconds"))}
    return {"steps_run": len(rows), "steps_counted": len(counted), "seconds": seconds,
            "window": (start, counted[-1]["time"]),
            "response_tokens": tokens, "tokens_per_s": tokens / seconds, "trainer_idle_frac": waited / seconds,
            "step_s_mean": seconds / len(counted), **{f"{k}_mean": v for k, v in mean.items()},
            "reward_first": rows[0]["reward/mean"], "reward_last": rows[-1]["reward/mean"],
            "staleness_mean": statistics.fmean(r["staleness/mean"] for r in counted),
            "lengths": length_figures(counted_lengths, max_new_tokens),
            "lengths_all_steps": length_figures([n for step in lengths for n in step], max_new_tokens)}


def overlap_bound(sync: dict) -> float:
    """Perfect overlap's speed-up over this sync run: ``(rollout_s + train_s) / max(rollout_s, train_s)``,
    rollout_s the trainer's mean wait for the step's rollout, train_s its mean training + weight-sync time."""
    rollout_s, train_s = sync["wait_s_mean"], sync["train_s_mean"] + sync["sync_s_mean"]
    return (rollout_s + train_s) / max(rollout_s, train_s)


def paused_bound(sync: dict) -> float:
    """Perfect overlap's speed-up over this sync run when the engines generate nothing while a sync loads
    their weights: the sync is on the rollout's path as on the trainer's, so an async step is at least
    ``max(rollout_s, train_s) + sync_s`` (train_s without the sync)."""
    rollout_s, train_s, sync_s = sync["wait_s_mean"], sync["train_s_mean"], sync["sync_s_mean"]
    return (rollout_s + train_s + sync_s) / (max(rollout_s, train_s) + sync_s)


def cpu_ceiling(sync_step_s: float, async_step_s: float, machine_busy_async: float) -> float:
    """The speed-up over a sync step of ``sync_step_s`` seconds at which the async run's CPU a step (its
    step of ``async_step_s`` seconds with ``machine_busy_async`` of the machine's cores busy) fills every
    core: ``sync_step_s / (async_step_s * machine_busy_async)``."""
    return sync_step_s / (async_step_s * machine_busy_async)


def run_mode(mode: str, run_dir: Path, overrides: list[str], roles: dict, long_every: int, skip: int,
             max_new_tokens: int) -> dict:
    """One run of ``recipe=tiny_moe_cpu`` in ``mode``: its steady-state figures and CPU seconds by role."""
    import psutil

    from megarl.train import main as train

    pinner, recorder, tail = CorePinner(roles), LengthRecorder(), LongTail(long_every)
    pinner.start()
    driver_cpu = sum(psutil.Process().cpu_times()[:2])
    try:
        code = train(["recipe=tiny_moe_cpu", f"mode={mode}", f"logging.run_dir={run_dir}", *overrides])
    finally:
        recorder.close()
        tail.close()
        pinning = pinner.stop()
        pinning["driver"] = {"cpus": "unpinned", "processes": 1,
                             "cpu_s": round(sum(psutil.Process().cpu_times()[:2]) - driver_cpu, 1)}
    if code != 0:
        raise RuntimeError(f"the {mode} run in {run_dir} failed")
    figures = loop_figures(run_dir, skip, recorder.steps, max_new_tokens)
    return {**figures, "cpu_by_role": pinning, "busy": pinner.busy(*figures["window"])}


def compare(sync: dict, asyn: dict) -> dict:
    """One repeat's async-over-sync figures and its two bounds (perfect overlap, engines paused for the sync)."""
    steps_ratio = sync["step_s_mean"] / asyn["step_s_mean"]  # same steps of the same samples
    bound, paused = overlap_bound(sync), paused_bound(sync)
    ceiling = cpu_ceiling(sync["step_s_mean"], asyn["step_s_mean"], asyn["busy"]["machine"])
    return {"async_over_sync_throughput": asyn["tokens_per_s"] / sync["tokens_per_s"],
            "async_over_sync_steps_per_s": steps_ratio, "overlap_bound": bound,
            "async_over_bound": steps_ratio / bound, "paused_bound": paused, "async_over_paused": steps_ratio / paused,
            "cpu_ceiling": ceiling, "ceiling_over_bound": ceiling / bound,
            "trainer_idle_frac_async": asyn["trainer_idle_frac"],
            "trainer_idle_frac_sync": sync["trainer_idle_frac"],
            **{f"{role}_busy_{mode}": run["busy"][role] for mode, run in (("sync", sync), ("async", asyn))
               for role in run["busy"]}}


def run_workload(name: str, work: Path, overrides: list[str], roles: dict, args, long_every: int,
                 max_new_tokens: int) -> dict:
    """``args.repeats`` sync + async pairs of one workload; the medians of their comparisons."""
    repeats = []
    for r in range(args.repeats):
        runs = {mode: run_mode(mode, work / f"{name}-{mode}{r}", overrides, roles, long_every, args.skip_steps,
                               max_new_tokens) for mode in ("sync", "async")}
        repeats.append({**compare(runs["sync"], runs["async"]), **runs})
        f = repeats[-1]
        print(f"{name} #{r}: async/sync {f['async_over_sync_steps_per_s']:.2f}x in steps/s "
              f"({f['async_over_sync_throughput']:.2f}x tokens/s), bound {f['overlap_bound']:.2f}x, "
              f"async_over_bound {f['async_over_bound']:.2f} (paused bound {f['paused_bound']:.2f}x, "
              f"async_over_paused {f['async_over_paused']:.2f}), CPU ceiling {f['cpu_ceiling']:.2f}x "
              f"({f['ceiling_over_bound']:.2f} of the bound); sync wait {f['sync']['wait_s_mean']:.2f} train "
              f"{f['sync']['train_s_mean']:.2f} sync {f['sync']['sync_s_mean']:.2f} s/step; busy sync/async: machine "
              f"{f['machine_busy_sync']:.2f}/{f['machine_busy_async']:.2f}, " + ", ".join(
                  f"{role} {f[f'{role}_busy_sync']:.2f}/{f[f'{role}_busy_async']:.2f}" for role in roles) +
              f"; lengths p50 "
              f"{f['sync']['lengths']['p50']} p90 {f['sync']['lengths']['p90']} max {f['sync']['lengths']['max']}")
    keys = [k for k, v in repeats[0].items() if isinstance(v, float)]
    return {**{k: statistics.median(r[k] for r in repeats) for k in keys},
            "workload": {"max_new_tokens": max_new_tokens, "ignore_eos_every": long_every,
                         "overrides": overrides}, "repeats": repeats}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, steps=60, prompts=64, max_new_tokens=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--long-every", type=int, default=10,
                        help="long_tail: every N-th sample ignores end-of-sequence (runs to --max-new-tokens)")
    parser.add_argument("--skip-steps", type=int, default=5, help="steps left out of the figures (start-up)")
    parser.add_argument("--trainer-cpus", default="0", help="cpulist of the trainer rank; '' leaves it unpinned")
    parser.add_argument("--engine-cpus", default="1", help="cpulist of the SGLang server; '' leaves it unpinned")
    parser.add_argument("--workloads", default="long_tail,demo", help="long_tail and/or demo (see above)")
    parser.add_argument("--repeats", type=int, default=3, help="sync + async pairs per workload; medians reported")
    parser.add_argument("--updates-per-step", type=int, default=6,
                        help="long_tail: optimizer steps per RL step (trainer.updates_per_step)")
    parser.add_argument("--lr", type=float, default=1e-7,
                        help="long_tail: RL learning rate (trainer.lr); the default holds the workload fixed")
    parser.add_argument("--override", action="append", default=[], help="more config overrides (repeatable)")
    args = parser.parse_args()

    roles = {role: cpu_list(text) for role, text in (("trainer", args.trainer_cpus), ("engine", args.engine_cpus))
             if text}
    if "engine" in roles:  # set before Ray starts: the Ray workers, and so the server, inherit them
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = args.engine_cpus
        os.environ["OMP_NUM_THREADS"] = str(len(roles["engine"]))

    from megarl.log import setup_logging
    from megarl.train import main as train

    setup_logging()
    work = work_directory(args.work_dir, "megarl-bench-")
    common = [*workload_overrides(work, args), f"rollout.temperature={args.temperature}", *args.override]
    if not (work / "warm" / "config.json").is_file():
        if train(["recipe=tiny_moe_cpu", "mode=warmup", f"logging.run_dir={work / 'warmup'}", *common]) != 0:
            return 1
    specs = {"long_tail": ([*common, f"trainer.updates_per_step={args.updates_per_step}", f"trainer.lr={args.lr}"],
                           args.long_every, args.max_new_tokens),
             "demo": ([o for o in common if not o.startswith("rollout.max_new_tokens=")] + ["rollout.max_new_tokens=3"],
                      0, 3)}
    result = {name: run_workload(name, work, *specs[name][:1], roles, args, *specs[name][1:])
              for name in args.workloads.split(",")}
    result = {**{f"{k}_{name}": w[k] for name, w in result.items()
                 for k in ("async_over_bound", "overlap_bound", "paused_bound", "async_over_paused",
                           "async_over_sync_steps_per_s", "machine_busy_async", "cpu_ceiling",
                           "ceiling_over_bound")},
              "goal": {"async_over_bound_at_least": BOUND_GOAL,
                       "met": all(w["async_over_bound"] >= BOUND_GOAL for w in result.values())},
              "steps": args.steps, "skipped_steps": args.skip_steps, "prompts_per_step": args.prompts,
              "samples_per_prompt": args.samples, "temperature": args.temperature,
              "pinning": {"trainer_cpus": roles.get("trainer"), "engine_cpus": roles.get("engine"),
                          "others": "unpinned (driver, Ray)", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                          "host_cpus": sorted(os.sched_getaffinity(0)), "load_avg_at_end": os.getloadavg()},
              **result}
    for name in args.workloads.split(","):
        print(f"{name}: medians of {args.repeats}: async_over_bound {result[f'async_over_bound_{name}']:.2f} "
              f"(async/sync {result[f'async_over_sync_steps_per_s_{name}']:.2f}x, bound "
              f"{result[f'overlap_bound_{name}']:.2f}x), async_over_paused {result[f'async_over_paused_{name}']:.2f} "
              f"(paused bound {result[f'paused_bound_{name}']:.2f}x), machine busy in async "
              f"{result[f'machine_busy_async_{name}']:.2f}, CPU ceiling {result[f'cpu_ceiling_{name}']:.2f}x "
              f"({result[f'ceiling_over_bound_{name}']:.2f} of the bound)")
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
