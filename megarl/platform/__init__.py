"""What megatron-core, megatron-bridge and SGLang need on a machine without a GPU; inactive on GPUs."""
