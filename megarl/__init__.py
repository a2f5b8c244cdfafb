"""megarl: Megatron-native RL post-training for large Mixture-of-Experts LLMs."""
