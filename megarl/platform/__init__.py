"""The machine a process runs on (``description``: the CPU or CUDA, from which every GPU decision is made)
and what megatron-core, megatron-bridge and SGLang need on one without a GPU (inactive on GPUs):
megatron's work-arounds (``megatron_cpu``), SGLang's (``sglang_cpu``, with batched attention in
``sglang_cpu_attention`` and top-k sampling in ``sglang_cpu_sampling``), ``torch.compile`` deferred to a
function's first call (``torch_compile``) and the named work-around with its switch (``workarounds``)."""
