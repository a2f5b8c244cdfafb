"""Rollout: the SGLang engines, the client, the rollout manager, rewards, tasks and datasets."""
