"""Adapter-only weight sync: each version's LoRA adapters, not the model, go to the engines.

One sync to version ``v``: the trainer writes its adapters as an HF PEFT directory
``{work_dir}/adapters/v{v}`` (``adapter_model.safetensors``: the adapters' bytes only; written
to ``v{v}.partial`` and renamed when complete; the newest version alone is kept), then on every
engine: ``/load_lora_adapter`` as ``megarl-{id}-v{v}`` (``id``: this sync's, so that
names never collide on an engine that outlives it) -> new requests name it
(``SGLangClient.adapter``) -> the engine's version label becomes ``v`` (aborting the requests in
flight when the caller's pause mode is ``ABORT``) -> ``/unload_lora_adapter`` of the previous
adapter, in the background (SGLang unloads it once no request uses it). Version 0 is the base
model, which a fresh adapter (``B = 0``) equals, so engines start without one. ``work_dir`` must
be visible to the trainer's rank 0 and to the engines (as for the disk transport).

No pause: an adapter is chosen per request, so the engine serves old and new adapters side by
side. A request keeps the adapter it named to its end and its tokens carry that adapter's version
(the client labels them), so per-token versions hold in every mode: with
``buffer.partial_rollout=continue`` (pause modes ``RETRACT`` / ``IN_PLACE``) requests in flight
finish on the previous adapter; with ``abort_resubmit`` (``ABORT``) they are aborted and
resubmitted, naming the new one.

An engine that rejects the adapter (``/load_lora_adapter`` answers with SGLang's reason) fails
the sync with :class:`megarl.sync.WeightSyncError` naming it and SGLang's message; the other
engines take the new adapter, the failed one keeps serving its previous adapter and version and
leaves the set of synced engines until :meth:`AdapterSync.recover`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import struct
import time
import uuid
from pathlib import Path
from typing import Protocol

from megarl.engines.types import EngineError, LoraAdapter, PauseMode
from megarl.sync.report import SenderStats, SyncReport
from megarl.sync.settings import SyncSettings
from megarl.sync.weight_sync import WeightSyncError

log = logging.getLogger(__name__)

WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterTrainer(Protocol):
    async def save_hf_adapter(self, out_dir: str) -> str:
        """Write the trainer's LoRA adapters as an HF PEFT directory at ``out_dir`` (collective)."""


class AdapterSync:
    """Same calls as :class:`megarl.sync.WeightSync` (``setup``, ``update``, ``recover``,
    ``close``), moving LoRA adapters. ``engines``: :class:`megarl.engines.client.SGLangClient` of
    engines started with LoRA serving (``EngineSettings.lora_max_rank``) at ``initial_version``."""

    def __init__(self, settings: SyncSettings, trainer: AdapterTrainer, engines: list, initial_version: int = 0):
        self.settings = settings
        self.trainer = trainer
        self.engines = list(engines)
        self.version = initial_version
        self.root = Path(settings.work_dir) / "adapters"
        self._lock = asyncio.Lock()
        self._prefix = f"megarl-{uuid.uuid4().hex[:8]}"
        self._unloads: set[asyncio.Future] = set()  # previous adapters' unloads, waiting for their requests

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def adapter_name(self, version: int) -> str:
        return f"{self._prefix}-v{version}"

    async def setup(self) -> None:
        """Nothing to link: adapters travel through ``work_dir``."""

    async def close(self) -> None:
        """Wait (up to ``timeout_s``) for the previous adapters' unloads."""
        if self._unloads:
            await asyncio.wait(set(self._unloads), timeout=self.settings.timeout_s)

    async def update(self, version: int, pause_mode: PauseMode = PauseMode.ABORT) -> SyncReport:
        """Export the trainer's adapters as ``version`` and switch every engine to them. The report (transport
        ``adapter``, one bucket: the adapter file): ``bytes`` the file's (its tensors and header; every engine
        rank reads it whole), ``tensors`` and ``largest_tensor_bytes`` its tensors', ``gather_s`` the trainer's
        export (gathers, PEFT conversion and the file's write: one call of megatron-bridge), ``convert_s`` 0
        (nothing is packed apart from that write), ``send_s`` the slowest engine's adapter load, ``load_s``
        from the export's end until every engine took the adapter."""
        async with self._lock:
            t0 = time.perf_counter()
            self.version = version
            path = await self._export(version)
            t_export = time.perf_counter() - t0
            engines = list(self.engines)
            if not engines:
                raise RuntimeError("no engine to sync (all failed: recover them first)")
            results = await asyncio.wait_for(
                asyncio.gather(*(self._switch(c, version, path, PauseMode(pause_mode)) for c in engines),
                               return_exceptions=True), self.settings.timeout_s)
            failed = [(c, r) for c, r in zip(engines, results) if isinstance(r, BaseException)]
            if failed:
                self.engines = [c for c in engines if all(c is not f for f, _ in failed)]
                reasons = "; ".join(f"{c.base_url}: {r}" for c, r in failed)
                raise WeightSyncError(f"adapter sync to version {version} failed on {len(failed)} engine(s): {reasons}",
                                      version, failed=[c.base_url for c, _ in failed], held=[])
            nbytes, sizes = (path / WEIGHTS_FILE).stat().st_size, tensor_bytes(path / WEIGHTS_FILE)
            total = time.perf_counter() - t0
            log.info("adapters of version %d synced into %d engines: %.2f MB, %.2f s", version, len(engines),
                     nbytes / 1e6, total)
            sent = SenderStats(stage=0, bytes=nbytes, buckets=1, tensors=len(sizes), gather_s=t_export,
                               send_s=max(results), peak_bucket_bytes=nbytes, largest_tensor_bytes=max(sizes))
            return SyncReport.of(sent, version, "adapter", len(engines), load_s=total - t_export, total_s=total)

    async def recover(self, client) -> None:
        """Give ``client``'s engine (failed, restarted or new) the current adapter and sync it from now on."""
        async with self._lock:
            if self.version and not self.path(self.version).is_dir():
                await self._export(self.version)
            client.adapter = None  # what a restarted engine holds; a live one may still hold the current adapter
            await self._switch(client, self.version, self.path(self.version), PauseMode.IN_PLACE)
            self.engines = [c for c in self.engines if c.base_url != client.base_url] + [client]

    async def _export(self, version: int) -> Path:
        partial, final = self.root / f"v{version}.partial", self.path(version)
        shutil.rmtree(partial, ignore_errors=True)
        await self.trainer.save_hf_adapter(str(partial))
        if not (partial / WEIGHTS_FILE).is_file():
            raise RuntimeError(f"the trainer wrote no {WEIGHTS_FILE} under {partial}")
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in self.root.glob("v*"):  # the newest version alone is kept
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    async def _switch(self, client, version: int, path: Path, mode: PauseMode) -> float:
        """Load ``path`` into ``client``'s engine as the adapter of ``version`` and name it in new requests;
        the seconds the engine took to load it (0 for version 0: the base model, no adapter)."""
        previous, t0 = client.adapter, time.perf_counter()
        if version:
            try:
                await client.load_lora_adapter(self.adapter_name(version), path)
            except EngineError as e:  # recovering an engine that loaded it before its sync failed
                if "already loaded" not in str(e):
                    raise
        loaded_s = time.perf_counter() - t0
        client.adapter = LoraAdapter(self.adapter_name(version), version) if version else None
        await client.set_weight_version(version, abort_all_requests=mode is PauseMode.ABORT)
        if previous is not None and previous != client.adapter:
            task = asyncio.ensure_future(_unload(client, previous.name))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)
        return loaded_s


def tensor_bytes(path: Path) -> list[int]:
    """The bytes of each tensor of the safetensors file at ``path`` (from its header: an 8-byte little-endian
    length, then JSON with each tensor's ``data_offsets``)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return [end - start for name, entry in header.items() if name != "__metadata__"
            for start, end in [entry["data_offsets"]]]


async def _unload(client, name: str) -> None:
    try:
        await client.unload_lora_adapter(name)
    except Exception as e:  # the engine died or restarted: nothing left to unload
        log.warning("%s: adapter %s not unloaded: %s", client.base_url, name, e)
