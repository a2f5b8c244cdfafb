"""Run metrics: the sink (``sink``: ``metrics.jsonl`` and, through ``tensorboard``, TensorBoard
scalars), GPU memory and utilisation from NVML (``gpu``) and the PNG of a run's curves (``plot``)."""
