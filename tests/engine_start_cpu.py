"""CPU seconds an SGLang engine's processes spent starting up, read right after it turned healthy."""
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class StartUpCpu:
    """User + system CPU seconds of the server process and of its engine children (scheduler,
    detokenizer; multiprocessing's resource tracker left out), and the children's command lines."""
    server_s: float
    children_s: float
    children: tuple[str, ...]


def start_up_cpu(pid: int) -> StartUpCpu:
    """The start-up CPU of the engine whose server process is ``pid`` (call it once the engine is healthy)."""
    server = psutil.Process(pid)
    children = [p for p in server.children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
    return StartUpCpu(sum(server.cpu_times()[:2]), sum(sum(p.cpu_times()[:2]) for p in children),
                      tuple(" ".join(p.cmdline()) for p in children))
