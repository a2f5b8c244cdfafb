"""Models: the tiny demo checkpoint, and HF checkpoint -> megatron-bridge -> Megatron GPTModel."""
