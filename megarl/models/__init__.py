"""Models: HF checkpoint -> megatron-bridge -> Megatron GPTModel (``bridge``, with only the checkpoint's
bridge imported: ``bridge_registry``), the reader of a checkpoint's ``config.json`` (``hf_config``),
which transformer layers the platform gets (``layers``), packed sequences through megatron's local
attention (``packed_attention``), megatron-core's load balancing counting the replayed routes
(``replayed_balancing``), the critic's value head (``value_head``), LoRA adapters (``lora``) and the tiny
demo checkpoint (``tiny_moe``)."""
