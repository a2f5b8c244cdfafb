"""CPU seconds per process role while a bench's run goes, sampled from /proc, to say where a step's CPU goes.

A :class:`CpuSampler` thread reads the CPU time (user + system) of this process and every descendant
every ``interval_s`` and keeps the samples with their wall-clock time; :meth:`CpuSampler.per_step`
then gives, per role, the CPU seconds a step between two wall-clock times (the metrics rows' ``time``):
the rate of use between the samples inside them times the seconds a step. Roles, by command line: the
SGLang server's HTTP and tokenizer process (``sglang_http``), its scheduler (``sglang_scheduler``) and detokenizer
(``sglang_detokenizer``), the trainer rank (``trainer``), the engine's Ray actor (``engine_actor``),
Ray's own processes (``ray``), this process (``driver``) and the rest (``other``).
"""
from __future__ import annotations

import bisect
import threading
import time

ROLES = (("sglang::scheduler", "sglang_scheduler"), ("sglang::detokenizer", "sglang_detokenizer"),
         ("megarl.engine_process.sglang_main", "sglang_http"), ("ray::TrainerRank", "trainer"),
         ("ray::EngineActor", "engine_actor"), ("ray", "ray"), ("gcs_server", "ray"), ("raylet", "ray"))


def role_of(cmdline: str) -> str:
    """The role of a process with this command line (the module docstring's names)."""
    return next((role for marker, role in ROLES if marker in cmdline), "other")


class CpuSampler(threading.Thread):
    """Samples (time.time(), {pid: (role, cpu seconds)}) of this process tree until :meth:`stop`."""

    def __init__(self, interval_s: float = 1.0):
        super().__init__(name="cpu-sampler", daemon=True)
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while True:
            self.sample_once()
            if self._halt.wait(self.interval_s):
                self.sample_once()
                return

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def sample_once(self) -> None:
        import psutil

        me = psutil.Process()
        seen: dict[int, tuple[str, float]] = {}
        for proc in [me, *me.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                role = "driver" if proc.pid == me.pid else role_of(" ".join(proc.cmdline()) or proc.name())
                seen[proc.pid] = (role, times.user + times.system)
            except psutil.Error:
                continue  # ended meanwhile
        self.samples.append((time.time(), seen))

    def per_step(self, start: float, end: float, steps: int) -> dict[str, float] | None:
        """Role -> CPU seconds a step between wall-clock ``start`` and ``end``, over which ``steps`` steps
        ran: the CPU used between the first and the last sample inside them, per second of that span, times
        the seconds a step. None when fewer than two samples fall inside (a window shorter than about two
        ``interval_s``). A process that ended or started between the samples counts what was seen of it."""
        times = [t for t, _ in self.samples]
        i, j = bisect.bisect_left(times, start), bisect.bisect_right(times, end) - 1
        if j <= i:
            return None
        (t_first, first), (t_last, last) = self.samples[i], self.samples[j]
        used: dict[str, float] = {}
        for pid, (role, cpu) in last.items():
            used[role] = used.get(role, 0.0) + cpu - first.get(pid, (role, 0.0))[1]
        seconds_per_step = (end - start) / steps
        return {role: round(s / (t_last - t_first) * seconds_per_step, 4) for role, s in sorted(used.items())}
