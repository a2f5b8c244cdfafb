"""The numbers of a held-out evaluation: pass@k and the ``eval/*`` row of one weight version.

pass@k is the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on Code"
(arXiv:2107.03374, section 2.1), as OpenAI's human-eval computes it (``human_eval/evaluation.py``,
``estimate_pass_at_k``): from ``n`` answers to a prompt of which ``c`` pass, the probability that at least
one of ``k`` answers drawn without replacement passes, ``1 - C(n - c, k) / C(n, k)``, taken as the product
``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no large binomials); averaged over the prompts.
"""
from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` passing answers of ``n`` (module docstring)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def sampled_metrics(rewards: Sequence[Sequence[float]], lengths: Sequence[Sequence[int]], threshold: float,
                    ks: Sequence[int]) -> dict[str, float]:
    """``eval/reward`` (mean over every answer), ``eval/pass@<k>`` for each of ``ks`` (an answer passes with a
    reward >= ``threshold``), ``eval/response_len_mean`` (tokens) from each prompt's sampled answers'
    ``rewards`` and ``lengths`` (as many answers for every prompt)."""
    n = len(rewards[0])
    answers = [r for per_prompt in rewards for r in per_prompt]
    out = {"eval/reward": sum(answers) / len(answers),
           "eval/response_len_mean": sum(t for per_prompt in lengths for t in per_prompt) / len(answers)}
    for k in dict.fromkeys(ks):
        out[f"eval/pass@{k}"] = sum(pass_at_k(n, sum(r >= threshold for r in per_prompt), k)
                                    for per_prompt in rewards) / len(rewards)
    return out


def greedy_metrics(rewards: Sequence[float], lengths: Sequence[int], threshold: float) -> dict[str, float]:
    """``eval/greedy/reward``, ``eval/greedy/pass`` (the share of prompts whose greedy answer passes) and
    ``eval/greedy/response_len_mean`` from one greedy answer a prompt."""
    return {"eval/greedy/reward": sum(rewards) / len(rewards),
            "eval/greedy/pass": sum(r >= threshold for r in rewards) / len(rewards),
            "eval/greedy/response_len_mean": sum(lengths) / len(lengths)}
