"""RL algorithms as pure functions on tensors and samples, with their config-name registries: advantage
estimators and the step's :func:`~megarl.algos.advantages.assign_advantages` (``advantages``),
per-turn process advantages (``process``), on-policy distillation's token advantages (``distill``),
policy losses, loss aggregation, KL estimators and off-policy corrections (``policy_loss``,
``aggregation``, ``kl``, ``off_policy``) and the loss they make up (``objective``); the ``algorithm``
config section (``settings``). Nothing of Megatron."""
