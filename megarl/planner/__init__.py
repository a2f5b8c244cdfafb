"""Arithmetic of the parallelism and memory planner (``python -m megarl.plan``), one concept a module:
architecture resolution (``arch``), parameter counts (``params``), byte units (``units``), trainer memory
(``trainer_memory``), engine memory (``engine_memory``), LoRA sizes (``lora``), weight sync
(``weight_sync``) and its delta memory (``delta_memory``), the per-token metadata's bytes and seconds a step
(``metadata``, at the rates in ``metadata_rates.json``), where each rank runs (``placement``) and the
plan of one layout (``layout``)."""
