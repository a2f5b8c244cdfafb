"""Which decoder layers each pipeline stage holds: megatron-core's split, even or uneven.

Even: every one of the ``pp * vpp`` virtual stages holds ``num_layers / (pp * vpp)`` layers.
Uneven (megatron's ``num_layers_in_first_pipeline_stage`` / ``..._last_...``, megarl's
``parallel.first_stage_layers`` / ``last_stage_layers``): the first and/or last stage hold the
given numbers and the stages between them split the rest evenly. With ``vpp`` virtual stages every
stage's layers are cut into ``vpp`` equal chunks, and chunk ``c`` of every stage comes before chunk
``c + 1`` of any stage (megatron's interleaved order). The rules are megatron-core 0.19's
(``TransformerConfig`` validation, ``get_transformer_layer_offset``); layer indices are 0-based.
"""
from __future__ import annotations


class PipelineSplitError(ValueError):
    """A split megatron-core refuses; ``key`` is the config key to change."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def stage_layer_counts(num_layers: int, pp: int, vpp: int = 1, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Decoder layers on each of the ``pp`` stages; raises :class:`PipelineSplitError`."""
    if first is None and last is None:
        if num_layers % (pp * vpp):
            raise PipelineSplitError("parallel.pp", f"{num_layers} layers do not split into pp*vpp = {pp * vpp} stages "
                                     "(set parallel.first_stage_layers / last_stage_layers for an uneven split)")
        return [num_layers // pp] * pp
    if pp < 2:
        raise PipelineSplitError("parallel.pp", "first_stage_layers / last_stage_layers need parallel.pp > 1")
    middle_layers, middle_stages = num_layers, pp
    for key, value in (("parallel.first_stage_layers", first), ("parallel.last_stage_layers", last)):
        if value is None:
            continue
        if value < 1 or value % vpp:
            raise PipelineSplitError(key, f"must be >= 1 and divisible by vpp={vpp}, got {value}")
        middle_layers -= value
        middle_stages -= 1
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        raise PipelineSplitError("parallel.first_stage_layers", f"{num_layers} layers leave {middle_layers} for "
                                 f"{middle_stages} middle stages (first={first}, last={last})")
    if middle_stages and middle_layers % (middle_stages * vpp):
        raise PipelineSplitError("parallel.pp", f"the {middle_layers} layers between the first and last stage do not "
                                 f"split into {middle_stages} stages x vpp={vpp}")
    per_middle = middle_layers // middle_stages if middle_stages else 0
    counts = [per_middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_layers(num_layers: int, pp: int, vpp: int, stage: int, first: int | None = None,
                 last: int | None = None) -> list[int]:
    """Decoder layer indices on pipeline ``stage``, in the order its chunks hold them."""
    counts = stage_layer_counts(num_layers, pp, vpp, first, last)
    chunks = [n // vpp for n in counts]  # layers per virtual chunk of each stage
    per_round = sum(chunks)  # one chunk of every stage
    start = sum(chunks[:stage])
    return [c * per_round + start + i for c in range(vpp) for i in range(chunks[stage])]
