"""Run metrics: the sink (``sink``: ``metrics.jsonl`` and, through ``tensorboard``, TensorBoard
scalars), the trackers besides it (``trackers``: TensorBoard, wandb, MLflow), GPU memory and utilisation
from NVML (``gpu``), the experts' load (``expert_load``), a held-out evaluation's numbers
(``evaluation``) and the PNG of a run's curves (``plot``)."""
