"""The per-token metadata (routes, sampling masks, log-probs, versions) from the engine's response to a
trainer rank's replay input, at the routing width of the 235B recipe, old path and new path side by side.

A tiny MoE with ``recipes/qwen3_235b_a22b.yaml``'s routing shape (94 MoE layers, 128 experts, top-8; hidden
32) is served by SGLang as megarl starts a policy engine, with sampling masks up to top-k 100. One batch of
``--prompts`` x ``--samples`` responses of ``--new-tokens`` tokens (top-k 100, routes and masks asked for)
is generated twice and recorded as the engine's HTTP bodies: once as SGLang's JSON (the old path) and
once with the compact binary metadata (:mod:`megarl.wire.metadata`, the new path).
Generation is then out of the figures: each recorded body goes through megarl's own code at full speed:

  decode      SGLangClient.samples_of: the body's JSON and metadata -> RolloutSamples    (driver)
  buffer      the groups into the RolloutBuffer and taken out for a step              (driver)
  batch       build_rl_batch: the step's samples -> the RLBatch's tensors              (driver)
  transfer    the RLBatch as Ray puts an argument for a trainer rank: pickled (protocol 5) with its arrays
              out of band, copied into the object store                                (driver)
  rank_input  the batch unpickled from the store (read-only, as a Ray object is), the rank's micro-batches
              on the host (micro_batches), each moved to the device when the schedule reaches it
              (:func:`megarl.trainer.rl_step.on_device`; a no-op on CPU)                (rank)

As the path runs, the driver and a trainer rank are processes of their own: ``--pipeline-repeats`` steps
run with the driver's stages in the bench's process and the rank's in another, the batch handed over
through shared memory standing for Ray's object store (a few steps in flight). Per path: ``tokens_per_s``
(response tokens over the wall seconds of that whole pipelined run), ``driver_cpu_s_per_token`` and
``rank_cpu_s_per_token`` (process CPU seconds of each side's stages a response token), ``core_share`` (each
process's CPU seconds over the run's wall seconds: the share of a core the machine gave it),
``tokens_per_cpu_bound_s`` (1 / the slower side's CPU a token: the rate with a core for each), ``stages`` (seconds,
CPU seconds and ``bytes_per_token`` of what each stage hands on: the body, the samples' arrays, the batch's
tensors, the pickle, the micro-batches); under ``one_process`` the same figures of ``--repeats`` steps with
every stage in turn in the bench's process; and ``new_over_old`` ratios. Both paths decode the same values:
the bench checks that the new path's samples of the JSON body converted by the engine's own function equal
the old path's, array for array.

Usage: python tools/bench/metadata.py --json FILE [--prompts 4 --samples 4 --new-tokens 256 --repeats 20]
       [--pipeline-repeats 100]
       [--work-dir D]   (a run with the same --work-dir and workload replays the bodies recorded before)
       [--rates megarl/planner/metadata_rates.json]   (the planner's rates, from this run)
       [--answer FILE --answer-copies N --prompt-tokens P --new-tokens R]   (replay an engine's JSON answer
       recorded beside its checkpoint instead of serving one; the new path's answer made from it by the engine's
       packing function)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import orjson
from work_dir import work_directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TOP_K = 100  # recipes/qwen3_235b_a22b.yaml's rollout.top_k
SHAPE = dict(num_layers=94, num_experts=128, topk=8)  # the 235B's routing: MoE layers, experts, top-k


def start_engine(work: Path, context: int):
    """An SGLangEngine serving a tiny MoE of the 235B's routing shape (not entered)."""
    from megarl.engines.server import EngineSettings, SGLangEngine
    from megarl.models.tiny_moe import TinyMoeSpec, make_tiny_moe

    spec = TinyMoeSpec(**SHAPE, hidden_size=32, moe_ffn_hidden_size=16, max_position_embeddings=context)
    checkpoint = work / "routing_235b"
    if not (checkpoint / "config.json").exists():
        make_tiny_moe(checkpoint, spec)
    return SGLangEngine(EngineSettings(model_path=str(checkpoint), dtype="float32", max_total_tokens=8 * context,
                                       sampling_mask_max_tokens=TOP_K, log_path=str(work / "server.log")))


async def record(engine, prompts: list[list[int]], new_tokens: int, compact: bool) -> bytes:
    """The engine's body for ``prompts`` asked as megarl asks (routes, sampling masks, log-probs)."""
    import httpx

    from megarl.engines.client import generate_payload
    from megarl.engines.types import SamplingParams
    from megarl.wire.metadata import HEADER, expert_dtype

    params = SamplingParams(max_new_tokens=new_tokens, top_k=TOP_K, ignore_eos=True)
    headers = {HEADER: expert_dtype(engine.model.num_experts).name} if compact else {}
    async with httpx.AsyncClient(base_url=engine.url, timeout=3600.0, headers=headers) as http:
        response = await http.post("/generate", json=generate_payload(prompts, params, True, True))
    response.raise_for_status()
    return response.content


def recorded(work: Path, prompts: list[list[int]], new_tokens: int) -> tuple[dict[str, bytes], object]:
    """The engine's old and new bodies for ``prompts`` (both asked at once: the engine batches them) and the
    served model; kept in ``work`` and read back by a later run with the same workload."""
    from megarl.engines.types import ServedModel

    key = f"{len(prompts)}x{len(prompts[0])}+{new_tokens}"
    files = {path: work / f"{path}-{key}.body" for path in ("old", "new")}
    if not all(f.exists() for f in files.values()):
        with start_engine(work, len(prompts[0]) + new_tokens + 8) as engine:
            async def both():
                return await asyncio.gather(*(record(engine, prompts, new_tokens, path == "new") for path in files))
            for f, body in zip(files.values(), asyncio.run(both())):
                f.write_bytes(body)
    model = ServedModel.from_hf_config(work / "routing_235b")
    return {path: f.read_bytes() for path, f in files.items()}, model


def from_answer(path: Path, copies: int) -> tuple[dict[str, bytes], object, list[list[int]]]:
    """An engine's recorded JSON answer (the old path's, ``copies`` times over as one batch), its binary form made
    by the engine's own function (the new path's), the model of its ``config.json`` beside it, and prompts of
    the answer's prompt lengths (the replay reads their lengths alone)."""
    from megarl.engines.types import ServedModel
    from megarl.wire.metadata import expert_dtype, pack_answer

    outs = orjson.loads(path.read_bytes()) * copies
    old = orjson.dumps(outs)
    model = ServedModel.from_hf_config(path.parent)
    prompts = [[1] * out["meta_info"]["prompt_tokens"] for out in outs]
    return {"old": old, "new": pack_answer(orjson.loads(old), expert_dtype(model.num_experts))}, model, prompts


def nbytes(value) -> int:
    """Bytes of the arrays and tensors in ``value`` (a sample, a batch, a micro-batch, lists of them)."""
    import dataclasses

    import torch

    if isinstance(value, (list, tuple)):  # token ids and other scalars are not metadata: not counted
        return 0 if not value or isinstance(value[0], (int, float, str)) else sum(nbytes(v) for v in value)
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if dataclasses.is_dataclass(value):
        return sum(nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


class Stages:
    """Seconds, process CPU seconds and bytes of each stage, summed over the repeats."""

    def __init__(self):
        self.seconds, self.cpu, self.bytes = {}, {}, {}

    def run(self, name: str, work, size=None):
        """``work()`` timed as stage ``name``; its result's bytes (``size(result)``, else :func:`nbytes`) counted."""
        t0, c0 = time.perf_counter(), time.process_time()
        result = work()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c0
        self.bytes[name] = self.bytes.get(name, 0) + (size or nbytes)(result)
        return result


def driver_stages(client, body: bytes, prompts: list[list[int]], samples_per_prompt: int, stages: Stages,
                  loop: asyncio.AbstractEventLoop, compact: bool, store) -> tuple[list, int]:
    """``body`` through the driver's stages once (the buffer's coroutines on ``loop``), the new path's with
    ``compact`` (``client`` asks for compact metadata), the batch put into ``store`` (``store(pickle parts)``
    copies them where the rank reads them); (what ``store`` returned, the response tokens)."""
    from megarl.pipeline.buffer import Group, RolloutBuffer
    from megarl.pipeline.ledger import Ledger
    from megarl.trainer.rl_batch import build_rl_batch

    groups = [f"g{i // samples_per_prompt}" for i in range(len(prompts))]
    stages.run("response", lambda: body, len)
    samples = stages.run("decode", lambda: client.samples_of(body, prompts, groups, (True, True)))
    for s in samples:  # the advantage step's output
        s.advantage = 0.5
    ledger = Ledger()
    ledger.prompts.buffered, ledger.samples.buffered = len(prompts) // samples_per_prompt, len(prompts)

    async def through_buffer():
        buffer = RolloutBuffer(len(prompts), None, ledger)
        for i in range(0, len(samples), samples_per_prompt):
            await buffer.reserve()
            await buffer.put(Group(i, samples[i : i + samples_per_prompt]))
        return (await buffer.take(len(prompts) // samples_per_prompt, trainer_version=0)).samples

    taken = stages.run("buffer", lambda: loop.run_until_complete(through_buffer()))
    batch = stages.run("batch", lambda: build_rl_batch(taken, trainer_version=0))
    # the old path's batch pickles as it did before RLBatch.__getstate__: its fields, each tensor in band
    def transfer():
        parts = pickled(batch if compact else dict(vars(batch)))
        return store(parts), sum(memoryview(p).nbytes for p in parts)

    stored, _ = stages.run("transfer", transfer, lambda out: out[1])
    return stored, sum(len(s.response_ids) for s in samples)


def rank_stage(parts: list, stages: Stages, compact: bool) -> None:
    """A trainer rank's side of one step: the batch unpickled from ``parts`` (the pickle, then its out-of-band
    buffers, read as the rank reads the object store), then its micro-batches, each moved to the device."""
    from megarl.trainer.packing import plan_micro_batches
    from megarl.trainer.rl_batch import RLBatch
    from megarl.trainer.rl_step import micro_batches, on_device

    def rank_input():
        received = pickle.loads(parts[0], buffers=parts[1:])
        received = received if compact else RLBatch(**received)
        plan = plan_micro_batches(received.lengths, 1, 4096, pack=True)
        return [on_device(_CpuModel, mb, mi) for mb, mi in micro_batches(received, plan, 0, pad_id=0)]

    stages.run("rank_input", rank_input)


def one_step(client, body: bytes, prompts: list[list[int]], samples_per_prompt: int, stages: Stages,
             loop: asyncio.AbstractEventLoop, compact: bool) -> int:
    """``body`` through every stage once, in this process (the object store a list of copies); its response
    tokens."""
    parts, tokens = driver_stages(client, body, prompts, samples_per_prompt, stages, loop, compact,
                                  lambda parts: [parts[0], *(bytearray(b) for b in parts[1:])])
    rank_stage(parts, stages, compact)
    return tokens


def pickled(batch) -> list:
    """``batch`` as Ray pickles an argument: protocol 5, its buffers out of band; [pickle, buffers...] (views)."""
    buffers = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    return [data, *(b.raw() for b in buffers)]


class _CpuModel:
    """Stands for a model chunk whose parameters are on the host (``model_device`` reads its first)."""

    @staticmethod
    def parameters():
        import torch

        yield torch.zeros(1)


DRIVER = ("decode", "buffer", "batch", "transfer")
SLOTS = 3  # batches in flight between the driver and the rank (the object store's share of the step)


class ObjectStore:
    """Stands for Ray's object store between the driver and a trainer rank: :data:`SLOTS` shared-memory slots
    (mapped once, as the store's arena is), each holding one batch's pickle parts at 64-byte-aligned offsets;
    the rank reads them as read-only views, as it reads a Ray object."""

    def __init__(self, slot_bytes: int):
        from multiprocessing import shared_memory

        self.slots = [shared_memory.SharedMemory(create=True, size=slot_bytes) for _ in range(SLOTS)]
        self.free = list(range(SLOTS))

    def put(self, slot: int, parts: list) -> tuple[int, list[tuple[int, int]]]:
        """``parts`` copied into ``slot``; (slot, [(offset, bytes), ...]) for the rank."""
        buf, at, places = self.slots[slot].buf, 0, []
        for part in parts:
            n = memoryview(part).nbytes
            if at + n > len(buf):
                raise ValueError(f"a batch of {at + n} bytes does not fit a slot of {len(buf)}")
            buf[at : at + n] = memoryview(part).cast("B")
            places.append((at, n))
            at += n + -n % 64
        return slot, places

    def close(self) -> None:
        for shm in self.slots:
            shm.close()
            shm.unlink()


def rank_process(conn, names: list[str], compact: bool) -> None:
    """The trainer rank's process: each step the driver sends, read from the store's slot and run through
    :func:`rank_stage`; the slot handed back when done; at the end its stages' figures."""
    from multiprocessing import shared_memory

    import torch

    torch.set_num_threads(1)  # as a trainer rank runs (megarl/trainer/actor.py)
    slots = [shared_memory.SharedMemory(name=name) for name in names]
    stages, buf, c0 = Stages(), None, time.process_time()
    while (message := conn.recv()) is not None:
        if message == "reset":  # the warm-up step is not counted
            stages, c0 = Stages(), time.process_time()
            continue
        slot, places = message
        buf = slots[slot].buf
        rank_stage([buf[a : a + n].toreadonly() for a, n in places], stages, compact)
        conn.send(slot)
    conn.send(({"seconds": stages.seconds, "cpu": stages.cpu, "bytes": stages.bytes}, time.process_time() - c0))
    del buf
    for shm in slots:
        shm.close()


def pipelined(client, body: bytes, prompts: list[list[int]], samples_per_prompt: int, compact: bool,
              repeats: int) -> tuple[Stages, Stages, int, float, dict]:
    """``repeats`` steps of ``body`` with the driver's stages in this process and the rank's in another, as they
    run: the batch handed over through an :class:`ObjectStore`, up to :data:`SLOTS` steps in flight, after one
    step not counted; (driver's stages, rank's stages, response tokens, wall seconds of the whole run, each
    process's CPU seconds over those wall seconds: the share of a core the machine gave it)."""
    import multiprocessing

    loop = asyncio.new_event_loop()
    sizes = []
    driver_stages(client, body, prompts, samples_per_prompt, Stages(), loop, compact,
                  lambda parts: sizes.extend(memoryview(p).nbytes + 64 for p in parts))
    store = ObjectStore(2 * sum(sizes))
    ours, theirs = multiprocessing.Pipe()
    rank = multiprocessing.get_context("spawn").Process(
        target=rank_process, args=(theirs, [shm.name for shm in store.slots], compact), daemon=True)
    rank.start()
    try:
        def step(stages: Stages) -> int:
            if not store.free:
                store.free.append(ours.recv())
            slot = store.free.pop()
            message, tokens = driver_stages(client, body, prompts, samples_per_prompt, stages, loop, compact,
                                            lambda parts: store.put(slot, parts))
            ours.send(message)
            return tokens

        step(Stages())
        store.free.append(ours.recv())  # the rank's imports and first calls: not counted
        ours.send("reset")
        driver, tokens, t0, c0 = Stages(), 0, time.perf_counter(), time.process_time()
        for _ in range(repeats):
            tokens += step(driver)
        while len(store.free) < SLOTS:
            store.free.append(ours.recv())
        wall, driver_cpu = time.perf_counter() - t0, time.process_time() - c0
        ours.send(None)
        (figures, rank_cpu), theirs_stages = ours.recv(), Stages()
        vars(theirs_stages).update(figures)
        rank.join(timeout=60)
    finally:
        if rank.is_alive():
            rank.kill()
        store.close()
        loop.close()
    return driver, theirs_stages, tokens, wall, {"driver": driver_cpu / wall, "rank": rank_cpu / wall}


def replay(model, body: bytes, prompts: list[list[int]], samples_per_prompt: int, compact: bool,
           repeats: int, pipeline_repeats: int) -> dict:
    """Figures of ``body``'s path: ``pipeline_repeats`` steps with the driver and the rank in processes of their own
    (:func:`pipelined`; ``tokens_per_s``, ``driver_cpu_s_per_token``, ``stages``), and under ``one_process``
    ``repeats`` steps of every stage in turn in this process (:func:`one_step`), after one not counted."""
    from megarl.engines.client import SGLangClient

    client = SGLangClient("http://unused", model, compact_metadata=compact)
    driver, rank, tokens, wall, shares = pipelined(client, body, prompts, samples_per_prompt, compact,
                                                   pipeline_repeats)
    both = Stages()
    for stages in (driver, rank):
        for name in ("seconds", "cpu", "bytes"):
            getattr(both, name).update(getattr(stages, name))
    result = figures(both, tokens, wall) | {"core_share": shares}
    # the pipeline's rate where each process holds a core of its own: its slower side's CPU a token
    result["tokens_per_cpu_bound_s"] = 1 / max(result["driver_cpu_s_per_token"], result["rank_cpu_s_per_token"])
    loop = asyncio.new_event_loop()
    one_step(client, body, prompts, samples_per_prompt, Stages(), loop, compact)  # imports, first calls: not counted
    stages, tokens = Stages(), 0
    t0 = time.perf_counter()
    for _ in range(repeats):
        tokens += one_step(client, body, prompts, samples_per_prompt, stages, loop, compact)
    loop.close()
    result["one_process"] = figures(stages, tokens, time.perf_counter() - t0)
    return result


def figures(stages: Stages, tokens: int, wall: float) -> dict:
    """A run's figures: response tokens over its ``wall`` seconds, the driver's CPU a token, each stage's."""
    driver_cpu = sum(stages.cpu[k] for k in DRIVER)
    return {"tokens": tokens, "tokens_per_s": tokens / wall, "wall_s": wall,
            "driver_cpu_s_per_token": driver_cpu / tokens, "rank_cpu_s_per_token": stages.cpu["rank_input"] / tokens,
            "bytes_per_token": {name: stages.bytes[name] / tokens for name in stages.seconds},
            "stages": {name: {"seconds": stages.seconds[name], "cpu_s": stages.cpu[name],
                              "bytes_per_token": stages.bytes[name] / tokens}
                       for name in stages.seconds}}


def rates(result: dict, model, prompt_tokens: int, response_tokens: int, command: str) -> dict:
    """The planner's rates (:mod:`megarl.planner.metadata`): each stage's CPU seconds over the bytes the planner
    counts for the bench's samples, per path."""
    from megarl.planner.metadata import STAGES, Width, bytes_per_sample

    width = Width(model.num_layers, model.topk, model.num_experts, model.vocab_size)
    out = {"command": command, "width": vars(width) | {"top_k": TOP_K}}
    for path in ("old", "new"):
        one = bytes_per_sample(path, width, prompt_tokens, response_tokens, TOP_K, True)
        samples = result[path]["tokens"] / response_tokens
        out[path] = {s: result[path]["stages"][s]["cpu_s"] / (one[s] * samples) for s in STAGES[1:]}
    return out


def check_same_values(model, old_body: bytes, prompts: list[list[int]]) -> None:
    """The new path's samples of ``old_body`` packed by the engine's own function equal the old path's."""
    from megarl.engines.client import SGLangClient
    from megarl.wire.metadata import expert_dtype, pack_answer

    new_body = pack_answer(orjson.loads(old_body), expert_dtype(model.num_experts))
    groups = [""] * len(prompts)
    old = SGLangClient("http://unused", model, compact_metadata=False).samples_of(old_body, prompts, groups,
                                                                                   (True, True))
    new = SGLangClient("http://unused", model).samples_of(new_body, prompts, groups, (True, True))
    for a, b in zip(old, new):
        assert np.array_equal(a.routed_experts, b.routed_experts)
        assert a.rollout_logprobs.tobytes() == b.rollout_logprobs.tobytes()
        assert np.array_equal(a.sampling_mask.ids, b.sampling_mask.ids)
        assert np.array_equal(a.sampling_mask.offsets, b.sampling_mask.offsets)
        assert np.array_equal(a.model_version, b.model_version)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="responses per prompt (a GRPO group)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20, help="replays of the recorded bodies per path")
    parser.add_argument("--pipeline-repeats", type=int, default=100, help="replays per path with the driver and "
                        "the rank in processes of their own (the path's throughput)")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--answer", default=None, help="replay this recorded JSON answer of the checkpoint in its "
                        "directory instead of recording (the new path's made from it by the engine's packing)")
    parser.add_argument("--answer-copies", type=int, default=16, help="copies of --answer's responses in a step")
    parser.add_argument("--rates", default=None, help="write the planner's rates here "
                        "(megarl/planner/metadata_rates.json)")
    args = parser.parse_args()
    work = work_directory(args.work_dir, "megarl-metadata-")
    rng = np.random.default_rng(0)
    prompts = [p for p in rng.integers(3, 300, (args.prompts, args.prompt_tokens)).tolist()
               for _ in range(args.samples)]
    if args.answer:
        bodies, model, prompts = from_answer(Path(args.answer), args.answer_copies)
    else:
        bodies, model = recorded(work, prompts, args.new_tokens)
    check_same_values(model, bodies["old"], prompts)
    import torch

    torch.set_num_threads(1)  # the driver's stages run as the driver does (megarl/train.py)
    result = {path: replay(model, bodies[path], prompts, args.samples, path == "new", args.repeats,
                           args.pipeline_repeats) for path in ("old", "new")}
    result["new_over_old"] = {
        "driver_cpu_s_per_token": result["new"]["driver_cpu_s_per_token"] / result["old"]["driver_cpu_s_per_token"],
        "tokens_per_s": result["new"]["tokens_per_s"] / result["old"]["tokens_per_s"]}
    result["workload"] = {"routing": SHAPE, "top_k": TOP_K, **{k: v for k, v in vars(args).items() if k != "json"}}
    Path(args.json).write_text(json.dumps(result, indent=2))
    if args.rates:
        source = f"--answer {args.answer} --answer-copies {args.answer_copies} " if args.answer else ""
        command = (f"python tools/bench/metadata.py --json F --rates {args.rates} {source}--prompts {args.prompts} "
                   f"--samples {args.samples} --prompt-tokens {args.prompt_tokens} --new-tokens {args.new_tokens} "
                   f"--repeats {args.repeats} --pipeline-repeats {args.pipeline_repeats}")
        Path(args.rates).write_text(json.dumps(rates(result, model, args.prompt_tokens, args.new_tokens, command),
                                               indent=2) + "\n")
    shown = ("tokens_per_s", "driver_cpu_s_per_token", "rank_cpu_s_per_token", "core_share", "tokens_per_cpu_bound_s")
    print(json.dumps({path: {k: result[path][k] for k in shown} for path in ("old", "new")}
                     | {"new_over_old": result["new_over_old"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
