"""The Megatron trainer: model building, log-probs, losses, optimizer, checkpoints."""
