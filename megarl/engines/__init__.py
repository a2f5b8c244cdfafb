"""The SGLang engines: the server process and its entry point (``server``, ``sglang_main``), how it is
launched on a platform (``launch_plan``), SGLang's model registry narrowed to the served architecture
(``model_registry``, ``sglang_models``), the engine side of weight loading (``pipelined_load``), the
HTTP client (``client``, with ``coalesce`` joining one event-loop turn's calls), the types engines and
their callers share (``types``), the Ray actor that supervises a server (``actor``), the engine pool
(``pool``), what rollout needs from engines (``protocol``) and the ``/dev/shm`` clean-up
(``shared_memory``). Nothing of rollout."""
