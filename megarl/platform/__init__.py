"""What megatron-core, megatron-bridge and SGLang need on a machine without a GPU (inactive on GPUs),
and how SGLang's processes pickle tensors beside megatron-core (:mod:`megarl.platform.sglang_ipc`,
every platform)."""
