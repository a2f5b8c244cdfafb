"""Weight sync: the trainer's Megatron shards -> HF-named buckets -> SGLang engines.

``WeightSync(settings, trainer, engines)``: ``await setup()``, ``await update(version, pause_mode)``
-> :class:`SyncReport`, ``await recover(client)``, ``await close()``; failures raise
:class:`WeightSyncError`. See ``protocol.py`` for the protocol, ``rank.py`` for the trainer side,
``buckets.py`` for the bucket format and ``transports/`` for the links. ``AdapterSync`` (same
calls) moves LoRA adapters only (``adapter.py``).
"""
from megarl.sync.adapter import AdapterSync
from megarl.sync.protocol import WeightSync, WeightSyncError
from megarl.sync.report import SyncReport
from megarl.sync.settings import SyncSettings

__all__ = ["AdapterSync", "WeightSync", "WeightSyncError", "SyncReport", "SyncSettings"]
