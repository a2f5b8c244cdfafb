"""One request of its own to one engine, for tests that need what the run never sends: a single
``/generate`` body (not joined with others) with a request id, and that request aborted alone. The run
sends batches only (``SGLangClient.generate_batch``) and aborts all at once (``abort_all_requests``)."""
from __future__ import annotations

from megarl.engines.client import SGLangClient, generate_payload
from megarl.engines.types import SamplingParams
from megarl.sample import RolloutSample
from megarl.wire.metadata import unpack_answer


async def generate_one(client: SGLangClient, prompt_ids: list[int], params: SamplingParams, *,
                       return_routed_experts: bool = True, return_sampling_mask: bool = True,
                       rid: str | None = None, group_id: str = "", episode_id: str = "") -> RolloutSample:
    """One response, with ``generate_batch``'s checks and sample (same errors, an aborted request's
    partial response); ``rid``: the request's id (for :func:`abort_request`)."""
    client._validate_prompt(prompt_ids)
    if return_sampling_mask and params.top_k <= 0:
        raise ValueError("return_sampling_mask needs a finite top_k (<= the engine's --sampling-mask-max-tokens)")
    await client._check_text_params(params)
    payload = generate_payload(list(prompt_ids), params, return_routed_experts, return_sampling_mask,
                               client.support_logprobs)
    if rid is not None:
        payload["rid"] = rid
    adapter = client._name_adapter(payload)
    out, section = unpack_answer((await client._post("/generate", payload)).content)
    return client._to_sample(list(prompt_ids), out, return_routed_experts, return_sampling_mask, group_id,
                             episode_id, adapter, section)


async def abort_request(client: SGLangClient, rid: str) -> None:
    """Abort request ``rid`` alone; its :func:`generate_one` returns the partial response."""
    await client._post("/abort_request", {"rid": rid})
