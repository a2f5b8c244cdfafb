"""Soak: the demo's workload (``recipe=tiny_moe_cpu``, async) for ``--steps`` steps (2000 by default), with
what a run holds sampled every ``--every`` steps, to show whether anything grows with the step count.

The bench starts a Ray cluster of its own (the driver joins it through ``RAY_ADDRESS``), runs the recipe's
warm-up, then the RL run as ``python -m megarl.train``, checkpointing every ``--save-interval`` steps
(``--override key=value`` adds any override, e.g. a keep setting for the checkpoints). At step 1 and at
every multiple of ``--every`` it samples:

  processes      every process of the run (the bench's descendants: the driver, Ray's daemons and workers,
                 the trainer rank, the engine actor, the SGLang server's processes), each by pid and role
                 (``process_cpu.role_of``): resident memory (RSS, bytes), open file descriptors, threads
  object_store   the Ray object store's bytes in use and its objects (the raylet's memory report)
  run_dir        the run directory's size on disk (bytes: checkpoints, metrics, logs, event files)

The report compares the first sample at or after ``--baseline-step`` (200: start-up, warm caches and the
async pipeline filling are over by then) with the last: per process alive at both, and per role summed,
the growth of RSS, open files and threads (percent of the baseline's); processes that started or ended
between them; the object store's and the run directory's growth; and the steps a second of the ``--every``
steps after the baseline against the last ``--every`` steps (``step_rate_ratio``: last / first). The
JSON holds every sample besides.

Usage: python tools/bench/soak.py --json FILE [--steps N --every K --baseline-step S --save-interval I
       --override key=value ... --work-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from demo_workload import add_workload_arguments, workload_overrides
from process_cpu import role_of
from work_dir import work_directory

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.5  # how often the bench reads the run's new metrics rows


def sample_processes(root_pid: int, driver_pid: int) -> list[dict]:
    """Every descendant of ``root_pid`` (the bench): pid, role, RSS bytes, open files, threads."""
    import psutil

    out = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            with proc.oneshot():
                role = "driver" if proc.pid == driver_pid else role_of(" ".join(proc.cmdline()) or proc.name())
                out.append({"pid": proc.pid, "role": role, "rss": proc.memory_info().rss,
                            "fds": proc.num_fds(), "threads": proc.num_threads()})
        except psutil.Error:
            continue  # ended meanwhile
    return out


def object_store_use(address: str) -> dict[str, int]:
    """Bytes in use and objects of the Ray object store (the raylet's memory report, as ``ray memory``)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    stats = get_memory_info_reply(get_state_from_address(address)).store_stats
    return {"bytes": int(stats.object_store_bytes_used), "objects": int(stats.num_local_objects)}


def directory_bytes(path: Path) -> int:
    """The size of the files under ``path`` (bytes)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def growth(before: float, after: float) -> float | None:
    """``after`` over ``before`` in percent of ``before`` (None when ``before`` is 0)."""
    return None if before == 0 else round(100.0 * (after - before) / before, 2)


def compare(base: dict, last: dict) -> dict:
    """Per process alive at both samples and per role, the growth of RSS, open files and threads; the
    processes that started or ended between them; the object store's and the run directory's growth."""
    before = {p["pid"]: p for p in base["processes"]}
    after = {p["pid"]: p for p in last["processes"]}
    kept = sorted(before.keys() & after.keys())
    per_process = [{"pid": pid, "role": after[pid]["role"],
                    **{f"{k}_growth_pct": growth(before[pid][k], after[pid][k]) for k in ("rss", "fds", "threads")},
                    **{f"{k}_at_baseline": before[pid][k] for k in ("rss", "fds", "threads")}} for pid in kept]
    roles: dict[str, dict] = {}
    for pid in kept:
        role = roles.setdefault(after[pid]["role"], {k: [0, 0] for k in ("rss", "fds", "threads")})
        for k in role:
            role[k][0] += before[pid][k]
            role[k][1] += after[pid][k]
    per_role = {r: {f"{k}_growth_pct": growth(*v) for k, v in parts.items()} for r, parts in sorted(roles.items())}
    return {"per_process": per_process, "per_role": per_role,
            "started": [after[p] for p in sorted(after.keys() - before.keys())],
            "ended": [before[p] for p in sorted(before.keys() - after.keys())],
            "object_store_growth_bytes": last["object_store"]["bytes"] - base["object_store"]["bytes"],
            "object_store_growth_objects": last["object_store"]["objects"] - base["object_store"]["objects"],
            "run_dir_growth_pct": growth(base["run_dir"], last["run_dir"]),
            "run_dir_bytes": [base["run_dir"], last["run_dir"]]}


def step_rate(rows: list[dict], first: int, last: int) -> float | None:
    """Steps a second between the rows of steps ``first`` and ``last`` (their wall-clock ``time``)."""
    times = {r["step"]: r["time"] for r in rows}
    if first not in times or last not in times or last <= first:
        return None
    return round((last - first) / (times[last] - times[first]), 4)


def new_rows(path: Path, offset: int) -> tuple[list[dict], int]:
    """The step rows (those with ``reward/mean``) written to ``path`` past byte ``offset``; the new offset
    (a line not yet ended is read again next time)."""
    if not path.is_file():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    rows = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return [r for r in rows if "reward/mean" in r], offset + end


def run_and_sample(command: list[str], env: dict, run_dir: Path, address: str, every: int) -> tuple[list, list, int]:
    """Run the driver ``command``, sampling at step 1 and every ``every`` steps; its rows, the samples and
    its exit status."""
    log = open(run_dir.parent / f"{run_dir.name}-driver.log", "ab")
    driver = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    rows, samples, offset = [], [], 0
    try:
        while True:
            ended = driver.poll() is not None
            fresh, offset = new_rows(run_dir / "metrics.jsonl", offset)
            for row in fresh:
                rows.append(row)
                if row["step"] == 1 or row["step"] % every == 0:
                    samples.append({"step": row["step"], "time": time.time(),
                                    "processes": sample_processes(os.getpid(), driver.pid),
                                    "object_store": object_store_use(address), "run_dir": directory_bytes(run_dir)})
                    print(f"step {row['step']}: {len(samples[-1]['processes'])} processes, "
                          f"RSS {sum(p['rss'] for p in samples[-1]['processes']) / 2**30:.2f} GiB, "
                          f"run dir {samples[-1]['run_dir'] / 2**20:.1f} MiB", flush=True)
            if ended:
                return rows, samples, driver.returncode
            time.sleep(POLL_S)
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()


def report(rows: list[dict], samples: list[dict], baseline_step: int, every: int) -> dict:
    """The comparison of the baseline sample with the last, and the step rates (the module docstring)."""
    base = next((s for s in samples if s["step"] >= baseline_step), None)
    if base is None or base is samples[-1]:
        raise SystemExit(f"no sample after the baseline step {baseline_step} (last step {rows[-1]['step']}): "
                         "run more --steps or lower --baseline-step")
    last = samples[-1]
    first_rate = step_rate(rows, base["step"], base["step"] + every)
    last_rate = step_rate(rows, last["step"] - every, last["step"])
    return {"baseline_step": base["step"], "last_step": last["step"], **compare(base, last),
            "steps_per_s_after_baseline": first_rate, "steps_per_s_last": last_rate,
            "step_rate_ratio": None if not (first_rate and last_rate) else round(last_rate / first_rate, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, steps=2000, prompts=64, max_new_tokens=3)
    parser.add_argument("--every", type=int, default=50, help="steps between samples")
    parser.add_argument("--baseline-step", type=int, default=200, help="growth is measured from this step")
    parser.add_argument("--save-interval", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--override", action="append", default=[], help="a further key=value override")
    args = parser.parse_args()
    if args.steps < args.baseline_step + 2 * args.every:
        parser.error(f"--steps {args.steps}: give at least --baseline-step + 2 x --every "
                     f"({args.baseline_step + 2 * args.every}) for two samples after the baseline")

    from megarl.trainer.launch import ray_for_run

    work = work_directory(args.work_dir, "megarl-soak-")
    with ray_for_run(8):  # Ray as a run starts it (its GCS's task events bounded as megarl bounds them)
        return soak(args, work)


def soak(args: argparse.Namespace, work: Path) -> int:
    """Warm up, run and sample the soak in ``work`` on the Ray this process is connected to; its exit status."""
    import ray

    common = workload_overrides(work, args)
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ADDRESS": address}
    train = [sys.executable, "-m", "megarl.train", "recipe=tiny_moe_cpu"]
    warm = subprocess.run([*train, "mode=warmup", f"logging.run_dir={work / 'warmup'}", *common], cwd=REPO, env=env)
    if warm.returncode != 0:
        return warm.returncode
    run_dir = work / "soak"
    command = [*train, "mode=async", f"logging.run_dir={run_dir}", f"trainer.save_interval={args.save_interval}",
               *common, *args.override]
    rows, samples, status = run_and_sample(command, env, run_dir, address, args.every)
    if status != 0:
        print(f"the run exited with status {status}: {run_dir.parent / (run_dir.name + '-driver.log')}")
        return status
    result = {"report": report(rows, samples, args.baseline_step, args.every), "samples": samples,
              "command": command, "workload": {"steps": args.steps, "every": args.every,
                                                "prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
                                                "max_new_tokens": args.max_new_tokens,
                                                "save_interval": args.save_interval, "overrides": args.override}}
    r = result["report"]
    print(f"steps {r['baseline_step']} -> {r['last_step']}: growth per role (RSS / open files / threads, %):")
    for role, g in r["per_role"].items():
        print(f"  {role:20s} {g['rss_growth_pct']} / {g['fds_growth_pct']} / {g['threads_growth_pct']}")
    print(f"processes started {len(r['started'])}, ended {len(r['ended'])}; object store "
          f"{r['object_store_growth_bytes']:+d} bytes, {r['object_store_growth_objects']:+d} objects; run dir "
          f"{r['run_dir_growth_pct']}%; steps/s {r['steps_per_s_after_baseline']} -> {r['steps_per_s_last']} "
          f"(ratio {r['step_rate_ratio']})")
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
