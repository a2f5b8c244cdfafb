"""When an in-process RL run's engine launches begin and its trainer ranks finish building: the
driver's ``EnginePool.launch`` and ``TrainerGroup.build`` wrapped (monkeypatch) to note the time."""
import time


def record_startup(monkeypatch) -> dict[str, list[float]]:
    """``{"launch": [monotonic start of each engine pool's launch], "built": [end of each build]}``, filled
    as the run starts."""
    from megarl.engines.pool import EnginePool
    from megarl.trainer.actor import TrainerGroup

    times: dict[str, list[float]] = {"launch": [], "built": []}
    launch, build = EnginePool.launch.__func__, TrainerGroup.build

    async def timed_launch(cls, *args, **kwargs):
        times["launch"].append(time.monotonic())
        return await launch(cls, *args, **kwargs)

    async def timed_build(self, *args, **kwargs):
        try:
            return await build(self, *args, **kwargs)
        finally:
            times["built"].append(time.monotonic())

    monkeypatch.setattr(EnginePool, "launch", classmethod(timed_launch))
    monkeypatch.setattr(TrainerGroup, "build", timed_build)
    return times
