"""The processes of one run of the driver, to check that they end with it: the driver's descendants (its
own Ray's, when it started one), the actors of other jobs of a Ray it joined (this test process's Ray serves
one test at a time), the SGLang servers of the run's model and their descendants; Ray's own daemons aside.
Used by tests/test_no_orphans.py (a driver with a Ray of its own) and tests/resume_runs.py (a driver joined
to the test process's Ray, killed mid-run)."""
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

GONE_WITHIN_S = 10.0
# Ray's own daemons of a Ray the driver started: they end with it on their own schedule (its agents
# outlive it by more than 10 s); they hold no GPU and are not megarl's or SGLang's processes
RAY_DAEMONS = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "dashboard.py",
               "log_monitor.py", "monitor.py")


@dataclass
class RunProcesses:
    """The processes found and how each was described then (a process killed since has no command line)."""

    processes: list[psutil.Process]
    described: str


def servers(model: Path) -> list[psutil.Process]:
    """The SGLang server processes serving ``model`` (its path is on their command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "megarl.engine_process.sglang_main" in cmdline and str(model) in cmdline:
            found.append(proc)
    return found


def run_processes(driver: psutil.Process, model: Path, joined: bool) -> RunProcesses:
    """The run's processes (module docstring), the driver itself left out; ``joined``: the driver joined
    this test process's Ray."""
    roots = [*(joined_actors() if joined else []), driver, *servers(model)]
    found = {p.pid: p for p in roots}
    for root in roots:
        found.update((child.pid, child) for child in root.children(recursive=True))
    found.pop(driver.pid)
    described = {p.pid: describe(p) for p in found.values()}
    kept = [p for p in found.values() if not any(daemon in described[p.pid] for daemon in RAY_DAEMONS)]
    return RunProcesses(kept, "\n".join(described[p.pid] for p in kept))


def joined_actors() -> list[psutil.Process]:
    """The processes of the alive actors of jobs other than this process's, on its Ray."""
    import ray
    from ray._private.state import actors

    own_job = ray.get_runtime_context().get_job_id()
    return [psutil.Process(info["Pid"]) for info in actors().values()
            if info["State"] == "ALIVE" and info["JobID"] != own_job and info["Pid"]]


def describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:160]}"
    except psutil.Error:
        return str(proc.pid)


def assert_gone_after_kill(run: RunProcesses) -> float:
    """Every process of ``run`` (a driver's, just killed) ends within GONE_WITHIN_S; the seconds the last
    took."""
    started = time.monotonic()
    _, alive = psutil.wait_procs(run.processes, timeout=GONE_WITHIN_S)
    assert not alive, (f"{len(alive)} of the run's {len(run.processes)} processes outlived the killed driver by "
                       f"{GONE_WITHIN_S:.0f} s:\n" + "\n".join(map(describe, alive)))
    return time.monotonic() - started
