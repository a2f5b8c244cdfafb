"""Weight sync: the trainer's Megatron shards -> HF-named buckets -> SGLang engines.

``WeightSync(settings, trainer, engines)``: ``await setup()``, ``await update(version, pause_mode)``
-> :class:`SyncReport`, ``await recover(client)``, ``await close()``; failures raise
:class:`WeightSyncError`. ``weight_sync.py`` drives the protocol from the driver,
``trainer_protocol.py`` says what it needs from a trainer, ``rank.py`` is a trainer rank's side: its
links (``link.py``, one class a sync mode: ``stage_link.py`` the stage path, ``gather.py`` its per-stage
gather, ``buckets.py`` the bucket format, ``delta.py`` its delta encoding; ``sharded_rank.py`` the sharded
path, with ``local_export.py`` a rank's own slices, ``slices.py`` the slice map and transfer plan and
``engine_layout.py`` the engines' layout), ``transports/`` the transports (a spec, a rank's half and the
driver's half each), ``abort.py`` and ``errors.py`` its bounds and failures, ``settings.py`` and
``report.py`` its settings and metrics. ``AdapterSync`` (same calls) moves LoRA adapters only
(``adapter.py``).
"""
from megarl.sync.adapter import AdapterSync
from megarl.sync.report import SyncReport
from megarl.sync.settings import SyncSettings
from megarl.sync.weight_sync import WeightSync, WeightSyncError

__all__ = ["AdapterSync", "WeightSync", "WeightSyncError", "SyncReport", "SyncSettings"]
