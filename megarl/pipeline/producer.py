"""The generation loop of the pipeline: keep the rollout buffer full of scored prompt groups.

It draws prompts (re-queued ones first, after a resume), reserves a buffer slot, waits until the
engines' weights are recent enough for the step the group will be trained at, generates the group
on the engines and puts it into the buffer. How far generation may run ahead is ``lag`` weight
versions: 0 for ``sync`` (each batch comes from the weights of the step before), 1 for
``one_step_off``, ``buffer.max_staleness`` for ``async``. Every prompt and sample attempt is
counted in the :class:`~megarl.pipeline.ledger.Ledger`.

Its data position (:meth:`RolloutProducer.position`) is what a checkpoint holds of the data; with
:meth:`RolloutProducer.carry` it also carries the buffer's groups and the partial groups in flight
(:mod:`megarl.pipeline.carried`), which a resumed run's producer takes back first.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable

from megarl.engines.types import PauseMode
from megarl.pipeline.buffer import Group, RolloutBuffer
from megarl.pipeline.carried import CarriedRollouts, PartialEntry
from megarl.pipeline.ledger import Ledger, Outcome
from megarl.sample import FinishReason
from megarl.tasks.prompts import BadPrompt

log = logging.getLogger(__name__)

# loop turns from a version change to the released groups' requests: the produce loop wakes and starts
# them (each runs eagerly up to its engine's request coalescer), then the coalescer sends their joint request
RELEASE_TURNS = 2
# seconds a checkpoint waits, after its abort pause, for the aborted requests' answers to be recorded (SGLang
# has answered them when the pause returns; a request that reached the engine after it waits for the continue)
CARRY_SETTLE_S = 5.0


class GenerationFailing(RuntimeError):
    """Every recent prompt group failed (rejected prompts, rewards that always raise): the run
    would never fill a batch."""


@dataclasses.dataclass(frozen=True)
class Production:
    """What the producer makes: ``prompts_per_step`` groups of ``samples_per_prompt`` samples a step, at most
    ``lag`` weight versions ahead (module docstring), with ``dynamic_sampling`` (groups whose samples all
    score the same are dropped and replaced)."""

    prompts_per_step: int
    samples_per_prompt: int
    lag: int
    dynamic_sampling: bool


@dataclasses.dataclass(frozen=True)
class ProducerStart:
    """Where a producer starts: the engines' weight version, the prompts drawn before and not trained
    (``requeue``, index -> prompt, drawn first), the next source index, and ``carried``: a checkpoint's
    rollouts (:mod:`megarl.pipeline.carried`) and the buffered groups' prompts, taken back before anything
    new is drawn (the ledger restored with them)."""

    engine_version: int = 0
    requeue: Iterable[tuple[int, object]] = ()
    next_index: int = 0
    carried: tuple[CarriedRollouts, dict[int, object]] | None = None


class RolloutProducer:
    """Fills ``buffer`` from ``source`` through ``manager`` until :meth:`stop`, as ``production`` says,
    from ``start``.

    ``manager.generate_group(prompt, group_id)`` returns an object with ``samples`` (one final
    sample per requested attempt; finish ``error`` = not scorable), ``resubmitted`` (aborted
    attempts sent again). ``source.next_batch(n)`` yields prompts; ``state_dict()`` is its position.
    ``fatal``: errors that end the run (no engine left), not just the group.
    """

    def __init__(self, manager, source, buffer: RolloutBuffer, ledger: Ledger, production: Production,
                 start: ProducerStart = ProducerStart(), *, fatal: tuple[type[BaseException], ...] = ()):
        self.manager, self.source, self.buffer, self.ledger = manager, source, buffer, ledger
        self.prompts_per_step, self.samples_per_prompt = production.prompts_per_step, production.samples_per_prompt
        self.lag, self.dynamic_sampling = production.lag, production.dynamic_sampling
        self.engine_version = start.engine_version
        self.outstanding: dict[int, object] = dict(start.requeue)  # index -> prompt: drawn, not trained or dropped
        self._queue = sorted(self.outstanding.items())
        carried = start.carried
        self._carried = carried[0] if carried is not None else None
        if carried is not None:
            self.outstanding |= carried[1] | {p.index: p.prompt for p in carried[0].partial}
        self._next_index = start.next_index
        self._version_changed = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        self.generated_tokens = 0  # response tokens of every group that came back
        self.generated_samples = 0  # samples of every group that came back
        self.bad_prompts = 0  # source rows that were no prompt (skipped, counted as prompt errors)
        self.fatal = fatal  # errors that end the run (no engine left), not just the group
        self.max_consecutive_failed_groups = max(64, 4 * production.prompts_per_step)
        self._consecutive_failed = 0
        self.failure: asyncio.Future = asyncio.get_running_loop().create_future()

    def _draw(self) -> tuple[int, object]:
        if self._queue:
            return self._queue.pop(0)
        prompt = self.source.next_batch(1)[0]
        index, self._next_index = self._next_index, self._next_index + 1
        self.outstanding[index] = prompt
        return index, prompt

    def _destined_step(self) -> int:
        """The step the next group will be trained at (groups not dropped, in order)."""
        p = self.ledger.prompts
        return (p.ended[Outcome.TRAINED] + p.buffered + p.in_flight) // self.prompts_per_step + 1

    async def set_engine_version(self, version: int) -> None:
        """The engines serve ``version`` now. Returns after :data:`RELEASE_TURNS` turns of the event loop:
        on the run's loop, whose tasks start eagerly (:func:`megarl.pipeline.run.start_tasks_eagerly`),
        the groups the version lets start have sent their joint request by then, before the step's own
        work (books, the next batch, the trainer call) holds the loop."""
        async with self._version_changed:
            self.engine_version = version
            self._version_changed.notify_all()
        for _ in range(RELEASE_TURNS):
            await asyncio.sleep(0)

    async def run(self) -> None:
        """Produce until cancelled. A failing group, or a source row that is no prompt, is logged and
        counted, fatal only as the last of ``max_consecutive_failed_groups`` in a row; anything else that ends
        production fails the run (:meth:`guard`) rather than leaving it waiting for groups that never come."""
        try:
            self._take_back()
            await self._produce()
        except Exception as exc:
            if not self.failure.done():
                self.failure.set_exception(exc)
            raise

    def _take_back(self) -> None:
        """The carried rollouts back: buffered groups into the buffer, partial groups continued."""
        carried, self._carried = self._carried, None
        if carried is None:
            return
        self.buffer.restore(carried.buffered, reserved=len(carried.partial))
        for entry in carried.partial:
            task = asyncio.create_task(self._one_group(entry.index, entry.prompt, entry.group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        log.info("resumed with %d buffered groups and %d partial groups carried by the checkpoint",
                 len(carried.buffered), len(carried.partial))

    async def _produce(self) -> None:
        while True:
            await self.buffer.reserve()
            async with self._version_changed:  # re-checked when the version changes or a group ends
                await self._version_changed.wait_for(
                    lambda: self.engine_version >= self._destined_step() - 1 - self.lag)
            try:
                index, prompt = self._draw()
            except BadPrompt as exc:
                self._bad_prompt(exc)
                await self.buffer.release()
                if self.failure.done():  # a source of nothing but such rows: the run ends (guard)
                    return
                continue
            self.ledger.started(1, self.samples_per_prompt)
            task = asyncio.create_task(self._one_group(index, prompt))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _count_failed(self, scored: bool, reason: str) -> None:
        """A group ended with (``scored``) or without a scorable sample; after
        ``max_consecutive_failed_groups`` failed ones in a row the run fails with ``reason``, the last one's."""
        self._consecutive_failed = 0 if scored else self._consecutive_failed + 1
        if self._consecutive_failed >= self.max_consecutive_failed_groups and not self.failure.done():
            self.failure.set_exception(GenerationFailing(
                f"the last {self._consecutive_failed} prompt groups all failed (last: {reason}); "
                "stopping instead of spinning"))

    def _bad_prompt(self, exc: BadPrompt) -> None:
        """A row of the source that is no prompt: one prompt ended as error (no samples started), and a failed
        group towards ``max_consecutive_failed_groups`` (a source of nothing but such rows stops the run)."""
        self.ledger.started(1, 0)
        self.ledger.dropped_in_flight(0, Outcome.ERROR)
        self._count_failed(False, str(exc))
        self.bad_prompts += 1
        if self.bad_prompts <= 5:
            log.warning("skipped a row that is no prompt (%d so far; counted in buffer/prompts_error%s): %s",
                        self.bad_prompts, ", the last warning" if self.bad_prompts == 5 else "", exc)

    async def _one_group(self, index: int, prompt, carried=None) -> None:
        g = self.samples_per_prompt
        try:
            more = {} if carried is None else {"carried": carried}
            result = await self.manager.generate_group(prompt, group_id=str(index), **more)
        except self.fatal as exc:
            if not self.failure.done():
                self.failure.set_exception(exc)
            return
        except Exception as exc:  # the engines failed this group for good: count it, carry on
            log.warning("prompt %d: generation failed (%s: %s); dropped as error", index, type(exc).__name__, exc)
            self.ledger.dropped_in_flight(g, Outcome.ERROR)
            self._count_failed(False, f"{type(exc).__name__}: {exc}")
            self._finished(index)
            await self.buffer.release()
            return
        if len(result.samples) < g:
            raise RuntimeError(f"prompt {index}: manager returned {len(result.samples)} samples for {g} attempts")
        if len(result.samples) > g:  # multi-agent episodes: a sample per role; the extra ones start here
            self.ledger.started(0, len(result.samples) - g)
            g = len(result.samples)
        self.ledger.resubmitted(result.resubmitted)
        scored = [s for s in result.samples if s.finish_reason != FinishReason.ERROR]
        self.generated_tokens += sum(len(s.response_ids) for s in result.samples)
        self.generated_samples += len(result.samples)
        self.ledger.returned(1 if scored else 0, len(scored), g - len(scored))
        self._count_failed(bool(scored), getattr(result, "rejected", None) or "every reward errored")
        if not scored:
            self._finished(index)
            await self.buffer.release()
        elif self.dynamic_sampling and len({(s.reward, s.turn_rewards) for s in scored}) == 1:  # no signal at all
            self.ledger.left_buffer(len(scored), Outcome.DROPPED_FILTER)  # no GRPO signal: refill
            self._finished(index)
            await self.buffer.release()
        else:
            await self.buffer.put(Group(index, scored))

    async def guard(self, awaitable):
        """Await ``awaitable`` unless generation fails for good first (then raise that error)."""
        task = asyncio.ensure_future(awaitable)
        await asyncio.wait([task, self.failure], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            self.failure.result()
        return task.result()

    def _finished(self, index: int) -> None:
        self.outstanding.pop(index, None)
        self._notify_soon()

    def _notify_soon(self) -> None:
        task = asyncio.create_task(self._notify())  # a dropped group lowers the destined step of the next
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _notify(self) -> None:
        async with self._version_changed:
            self._version_changed.notify_all()

    def taken(self, groups: Iterable[Group]) -> None:
        """The trainer took (or dropped as stale) these groups: their prompts are done."""
        for group in groups:
            self.outstanding.pop(group.index, None)
        self._notify_soon()

    async def stop(self) -> None:
        """Cancel generation; groups in flight are counted as not started (re-queued on resume)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def position(self, carried: CarriedRollouts | None = None) -> dict:
        """The data position: the source's state, the next draw index, every prompt drawn but not
        finished (re-queued first on resume, with its index) unless ``carried`` holds its group, the
        carried rollouts and the ledger's counts (those of ``carried`` as in flight and buffered)."""
        kept = set() if carried is None else carried.indices
        counts = None if carried is None else carried.counts(self.samples_per_prompt)
        requeue = [[i, dataclasses.asdict(p)] for i, p in sorted(self.outstanding.items()) if i not in kept]
        position = {"source": self.source.state_dict(), "next_index": self._next_index, "requeue": requeue,
                    "ledger": self.ledger.state_dict(counts)}
        if carried is not None:
            position["carried"] = carried.to_plain(self.outstanding)
        return position

    async def carry(self, pool) -> dict:
        """The data position with the rollouts under way carried (:mod:`megarl.pipeline.carried`): the
        buffer's groups, and each single-turn group in flight as far as its requests have come back. To
        read those, ``pool`` (the policy's engines) pauses once with ``abort``: the requests in flight come
        back with their tokens so far and are resubmitted (their prefix and routes), to run on once it
        continues. Groups with nothing back yet (and every multi-turn episode: an environment's state is
        not carried) are re-queued."""
        if self.manager.episodes is not None:
            return self.position(CarriedRollouts(self.buffer.groups(), []))
        mark = self.manager.mark()
        await pool.pause(PauseMode.ABORT)
        try:
            if not await self.manager.returned(mark, CARRY_SETTLE_S):
                log.warning("checkpoint: some requests in flight did not come back within %.0f s; their groups are "
                            "carried as far as recorded before", CARRY_SETTLE_S)
            return self.position(self._carried_now())
        finally:
            await pool.continue_generation()

    def _carried_now(self) -> CarriedRollouts:
        """The buffer's groups and every group in flight the manager has samples of, at this moment."""
        buffered = self.buffer.groups()
        in_buffer = {g.index for g in buffered}
        partial = [PartialEntry(i, p, self.manager.in_flight[str(i)]) for i, p in sorted(self.outstanding.items())
                   if i not in in_buffer and str(i) in self.manager.in_flight]
        return CarriedRollouts(buffered, partial)
