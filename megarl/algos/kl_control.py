"""The coefficient of the KL penalty to the reference policy, step by step (``algorithm.kl_ctrl``).

``fixed`` keeps ``algorithm.kl_coef``. ``adaptive`` is the controller of Ziegler et al. 2019
(arXiv 1909.08593) as verl's ``AdaptiveKLController`` (``verl/trainer/ppo/core_algos.py``) and SkyRL's
(``skyrl/backends/skyrl_train/utils/ppo_utils.py``) write it: after a step whose measured KL is ``kl``
over ``n`` samples,

    e = clip(kl / target - 1, -0.2, 0.2)
    beta <- beta * (1 + e * n / horizon)

starting from ``beta = kl_coef``. verl updates it where the penalty goes into the reward
(``apply_kl_penalty`` in ``verl/trainer/ppo/ray_trainer.py``): the step's rewards take the coefficient
before the update, ``kl`` is the batch mean of each sample's token-mean KL estimate and ``n`` the batch's
sample count.
"""
from __future__ import annotations

from dataclasses import dataclass

KL_CONTROLLERS = ("fixed", "adaptive")


@dataclass
class KLController:
    """The KL coefficient of the next step (``value``) and how it moves (module docstring). ``kind``
    ``fixed`` never moves; ``adaptive`` needs ``target`` > 0 and ``horizon`` > 0."""

    value: float
    kind: str = "fixed"
    target: float = 0.1
    horizon: float = 10000.0

    def __post_init__(self):
        if self.kind not in KL_CONTROLLERS:
            raise ValueError(f"unknown kl_ctrl {self.kind!r}; valid: {', '.join(KL_CONTROLLERS)}")
        if self.kind == "adaptive" and not (self.target > 0 and self.horizon > 0):
            raise ValueError(f"the adaptive KL controller needs kl_target > 0 and kl_horizon > 0, got "
                             f"{self.target}, {self.horizon}")

    def update(self, kl: float, n_steps: int) -> float:
        """Move the coefficient after a step that measured ``kl`` over ``n_steps`` samples; the new value."""
        if self.kind == "adaptive":
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps: the current coefficient."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])

    @classmethod
    def from_config(cls, algorithm) -> KLController:
        """The controller ``algorithm`` (``AlgorithmConfig``) names: ``kl_ctrl`` from ``kl_coef``, ``kl_target``
        and ``kl_horizon``."""
        return cls(value=float(algorithm.kl_coef), kind=algorithm.kl_ctrl, target=float(algorithm.kl_target),
                   horizon=float(algorithm.kl_horizon))
