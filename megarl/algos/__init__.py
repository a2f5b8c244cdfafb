"""RL algorithms as pure functions on tensors and samples, with their config-name registries (``registry``):
advantage estimators and the step's :func:`~megarl.algos.advantages.assign_advantages` (``advantages``),
GAE from a critic's values (``gae``), per-turn process advantages (``process``), on-policy distillation's
token advantages (``distill``), policy losses, loss aggregation, KL estimators and the KL coefficient
(``policy_loss``, ``aggregation``, ``kl``, ``kl_control``), off-policy corrections, token and sequence
rejection, score centering and the importance weights' diagnostics (``off_policy``, ``rejection``,
``score_centering``, ``is_diagnostics``), the critic's value loss (``value_loss``) and the loss they make
up (``objective``); their config section (``settings``). Nothing of Megatron."""
