"""The code loaded inside an engine's SGLang processes (every platform), entered through ``sglang_main``
(``python -m megarl.engine_process.sglang_main``): megatron kept out of the server's imports
(``import_guard``), SGLang's model registry narrowed to the served architecture (``model_registry``,
``sglang_models``), how the processes pickle tensors (``ipc``), the engine side of weight loading
(``pipelined_load``, with ``sharded_load`` for sharded buckets), weight-update groups joined within the
driver's bound (``update_group``), the routes a request keeps for its prefix and their replay when it is
computed again (``kept_routes``, ``route_replay``), answers' per-token metadata packed as binary arrays
(``compact_metadata``), a paused scheduler's wait (``paused_wait``), the data-parallel controller's wait
(``controller_wait``) and the tokenizer's stops in a server started without it (``tokenizer_stops``). The
CPU work-arounds it also applies are :mod:`megarl.platform`'s. Nothing of the driver side: what it shares with it is
:mod:`megarl.wire`."""
