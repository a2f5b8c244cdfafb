"""HF transformers as the independent oracle: router top-k, forced routing, masked log-probs."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import numpy as np
import torch

from megarl.sample import FinishReason, RolloutSample, SamplingMask


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def moe_gates(model) -> list:
    return [layer.mlp.gate for layer in model.model.layers]


@contextlib.contextmanager
def forced_routing(model, experts: torch.Tensor, logits_seen: dict | None = None):
    """Route every token through ``experts`` [T, L, k] (one sequence), weights = softmax over them;
    ``logits_seen`` (when given) gets each layer's router logits [T, E] by layer index."""
    gates = moe_gates(model)
    originals = [g.forward for g in gates]

    def make(layer, gate):
        def forward(hidden):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            if logits_seen is not None:
                logits_seen[layer] = logits
            ids = experts[: hidden.shape[0], layer].long()
            weights = torch.softmax(logits.gather(1, ids), dim=-1)
            return logits, weights, ids
        return forward

    for layer, gate in enumerate(gates):
        gate.forward = make(layer, gate)
    try:
        yield
    finally:
        for gate, forward in zip(gates, originals):
            gate.forward = forward


def hf_values(hf_path: str, batch, head: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A value head's values of an RLBatch ``batch``, ragged [N], 0 off its trained positions: the HF
    backbone's last hidden state (after the final norm) times the head's weight [1, h] plus its bias [1]."""
    hf, (weight, bias), rows = load_hf(hf_path), head, []
    for b in range(len(batch)):
        tokens = batch.tokens[batch.cu_seqlens[b]:batch.cu_seqlens[b + 1]]
        with torch.no_grad():
            hidden = hf.model(tokens[None]).last_hidden_state[0]
        rows.append(hidden @ weight[0] + bias[0])
    return torch.cat(rows) * batch.loss_mask


def replayed_forward(model, ids: list[int], routes: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """The forward of ``ids[:-1]`` with every token routed through ``routes`` [T-1, L, k] (the
    trainer's Keep Routing): each layer's own top-k under that forward [T-1, L, k] (sorted per row) and
    the log-probs [T-1, V]."""
    seen: dict[int, torch.Tensor] = {}
    with torch.no_grad(), forced_routing(model, torch.from_numpy(routes.astype(np.int64)), seen):
        logits = model(torch.tensor([ids[:-1]])).logits[0]
    k = model.config.num_experts_per_tok
    own = np.stack([torch.topk(seen[layer].float(), k, dim=-1).indices.numpy() for layer in sorted(seen)], axis=1)
    return np.sort(own, -1), torch.log_softmax(logits.float(), -1)


def router_topk(model, tokens: torch.Tensor) -> torch.Tensor:
    """[T, L, k] expert ids HF routes the tokens of one sequence to."""
    with torch.no_grad():
        out = model(tokens[None], output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([torch.topk(torch.softmax(r.float(), -1), k, dim=-1).indices for r in out.router_logits], dim=1)


def make_samples(model, n: int, top_k: int, seed: int, rotate_experts: int = 0) -> list[RolloutSample]:
    """Samples whose ``rollout_logprobs`` are HF's log-probs renormalised over each position's top-k
    set (plus the target), with the routing HF used (rotated by ``rotate_experts`` when non-zero:
    the reference is then computed under that forced routing)."""
    gen = torch.Generator().manual_seed(seed)
    E = model.config.num_experts
    samples = []
    for i in range(n):
        P, R = int(torch.randint(3, 7, (1,), generator=gen)), int(torch.randint(2, 6, (1,), generator=gen))
        seq = torch.randint(3, 259, (P + R,), generator=gen)
        experts = (router_topk(model, seq[:-1]) + rotate_experts) % E
        with torch.no_grad(), (forced_routing(model, experts) if rotate_experts else contextlib.nullcontext()):
            logits = model(seq[None, :-1]).logits[0]
        rows, logprobs = [], []
        for r in range(R):
            pos, target = P - 1 + r, int(seq[P + r])
            kept = set(torch.topk(logits[pos], top_k).indices.tolist()) | {target}
            ids = sorted(kept)
            rows.append(ids)
            logprobs.append(float(torch.log_softmax(logits[pos, ids], -1)[ids.index(target)]))
        samples.append(RolloutSample(
            prompt_ids=seq[:P].tolist(), response_ids=seq[P:].tolist(), loss_mask=np.ones(R, np.uint8),
            rollout_logprobs=np.array(logprobs, np.float32), model_version=np.zeros(R, np.int32),
            routed_experts=experts.numpy().astype(np.int16), sampling_mask=SamplingMask.from_rows(rows),
            finish_reason=FinishReason.STOP, advantage=float(torch.randn(1, generator=gen)), group_id=f"g{i // 4}",
        ))
    return samples


def sharpened_checkpoint(src: str, dst: Path, scale: float) -> Path:
    """A copy of the HF checkpoint ``src`` at ``dst`` with its lm_head scaled by ``scale``: greedy
    decoding then has no near-ties, so engine and HF pick the same tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    for f in Path(src).iterdir():
        shutil.copy(f, dst / f.name)
    weights = load_file(dst / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * scale
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def eos_or_seven_checkpoint(src: str, dst: Path, tokenizer) -> Path:
    """A copy of ``src`` at ``dst`` whose lm_head gives logits +-5 * sum(h) for end-of-sequence and '7', 0
    elsewhere: the model writes sevens and ends with EOS wherever sum(h) > 0 (real contexts reach it
    within a few tokens), so its answers are short and predictable."""
    import shutil

    from safetensors.torch import load_file, save_file

    for f in Path(src).iterdir():
        shutil.copy(f, dst / f.name)
    weights = load_file(dst / "model.safetensors")
    head = torch.zeros_like(weights["lm_head.weight"])
    head[tokenizer.eos_token_id] = 5.0
    head[tokenizer.encode("7", add_special_tokens=False)[0]] = -5.0
    weights["lm_head.weight"] = head
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def assert_sample_matches_hf(sample: RolloutSample, model, tolerance: float, temperature: float = 1.0) -> float:
    """Routing rows equal HF's top-k for every fed token; every policy token is inside its mask and its
    log-prob equals HF's (at ``temperature``) renormalised over the mask within ``tolerance``; tokens the
    policy did not write (loss mask 0: tool results, user turns) have log-prob 0 and a mask of just
    themselves. Returns the largest log-prob difference."""
    ids = sample.prompt_ids + sample.response_ids
    p = len(sample.prompt_ids)
    with torch.no_grad():
        out = model(torch.tensor([ids[:-1]]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    hf_topk = np.stack([torch.topk(r.float(), k, dim=-1).indices.numpy() for r in out.router_logits], axis=1)
    assert sample.routed_experts.shape == (len(ids) - 1, model.config.num_hidden_layers, k)
    np.testing.assert_array_equal(np.sort(sample.routed_experts, -1), np.sort(hf_topk, -1))
    log_probs = torch.log_softmax(out.logits[0, p - 1:].float() / temperature, dim=-1)
    worst = 0.0
    for i, token in enumerate(sample.response_ids):
        kept = sample.sampling_mask.row(i)
        assert token in kept.tolist(), f"token {token} at {i} outside its mask"
        if sample.loss_mask[i] == 0:
            assert kept.tolist() == [token] and sample.rollout_logprobs[i] == 0.0
            continue
        kept_t = torch.from_numpy(kept.astype(np.int64))
        expected = (log_probs[i, token] - torch.logsumexp(log_probs[i, kept_t], dim=0)).item()
        worst = max(worst, abs(expected - float(sample.rollout_logprobs[i])))
    assert worst < tolerance, f"log-prob difference {worst}"
    return worst


def assert_sample_matches_replayed_hf(sample: RolloutSample, model, tolerance: float, first_routed: int = 0) -> float:
    """Every response token's log-prob equals HF's (renormalised over its mask) within ``tolerance`` in a
    forward that replays the sample's routes (:func:`replayed_forward`), and the routes from row
    ``first_routed`` on are the router's own choice in that forward. Returns the largest log-prob difference."""
    ids, p = sample.prompt_ids + sample.response_ids, len(sample.prompt_ids)
    own, log_probs = replayed_forward(model, ids, sample.routed_experts)
    np.testing.assert_array_equal(np.sort(sample.routed_experts, -1)[first_routed:], own[first_routed:])
    worst = 0.0
    for i, token in enumerate(sample.response_ids):
        kept = torch.from_numpy(sample.sampling_mask.row(i).astype(np.int64))
        expected = (log_probs[p - 1 + i, token] - torch.logsumexp(log_probs[p - 1 + i, kept], 0)).item()
        worst = max(worst, abs(expected - float(sample.rollout_logprobs[i])))
    assert worst < tolerance, f"log-prob difference {worst}"
    return worst


def hf_from_state(checkpoint: str, state: dict, tmp_path: Path):
    """The HF model loaded (through transformers' own checkpoint conversion) from ``state``."""
    from safetensors.torch import save_file

    path = tmp_path / "hf_reference"
    path.mkdir(exist_ok=True)
    shutil.copy(Path(checkpoint) / "config.json", path / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors", metadata={"format": "pt"})
    return load_hf(str(path))


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs (full vocabulary, temperature 1) from an HF model."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(logp.argmax()))
            logprobs.append(float(logp[ids[-1]]))
    return ids[len(prompt):], logprobs
