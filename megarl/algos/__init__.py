"""RL algorithms as pure functions on torch tensors: advantages, policy losses, aggregation, KL,
off-policy correction."""
