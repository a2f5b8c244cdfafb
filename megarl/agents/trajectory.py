"""An agent episode's recorded engine calls, and how they become :class:`RolloutSample` s.

A :class:`Trajectory` holds the calls of one episode (one gateway session) in :class:`Segment` s:
a segment is a chain of calls of one role in which every call's prompt (the token ids fed to the
engine) is the previous call's prompt + its generated tokens + the tokens of what came in between
(tool results, user turns, the chat template's tags). The gateway decides which segment a call
extends (``megarl/agents/gateway.py``); here a segment becomes one sample
(docs/architecture.md, "The sample"), with the conventions of ``megarl/rollout/env.py``:

- ``prompt_ids``: the first call's prompt; ``response_ids``: everything after it, up to the last
  call's last generated token;
- generated tokens: the engine's log-probs, versions and sampling-mask rows, ``loss_mask`` 1;
- tokens in between calls: ``loss_mask`` 0, log-prob 0.0, the version of the token before them and
  a sampling-mask row holding just the token;
- ``routed_experts``: the last call's, whose prompt held every earlier token, so its rows cover the
  whole sample (checked: each call's prompt must be exactly the segment so far, else ValueError);
- ``turn_ends``: the response offset after each call's generated tokens (an aborted call continued
  by the gateway ends its turn only with its continuation).
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from megarl.sample import RolloutSample, SamplingMask


@dataclass(frozen=True)
class Call:
    """One engine generation: ``sample`` as the engine returned it (its ``prompt_ids`` are the ids
    fed). ``turn_end`` False for the aborted first part of a call the gateway continued."""

    sample: RolloutSample
    turn_end: bool = True


@dataclass
class Segment:
    """A chain of calls of one ``role``. ``key``: the text a later call's rendered prompt must start
    with to extend this segment (the last prompt's text + the completion text returned + the text of
    the special token that ended the generation, if one did); ``pending``: a call on it is in flight (no other call may
    extend it meanwhile)."""

    role: str
    calls: list[Call] = field(default_factory=list)
    key: str = ""
    pending: bool = False

    @property
    def token_ids(self) -> list[int]:
        """The last call's prompt + generated ids: what a call extending this segment starts with."""
        last = self.calls[-1].sample
        return last.prompt_ids + last.response_ids

    @property
    def response_length(self) -> int:
        """Response tokens so far (everything after the first call's prompt)."""
        return len(self.token_ids) - len(self.calls[0].sample.prompt_ids)

    @property
    def final_turn_ids(self) -> list[int]:
        """The tokens the last call generated (all its pieces when it was continued after an abort)."""
        ids: list[int] = []
        for i, call in enumerate(self.calls):
            if i and self.calls[i - 1].turn_end:
                ids = []
            ids += call.sample.response_ids
        return ids


@dataclass
class Trajectory:
    """The segments of one episode, in the order they were opened."""

    segments: list[Segment] = field(default_factory=list)

    @property
    def roles(self) -> list[str]:
        """Roles that recorded at least one call, in order of their first call."""
        return list(dict.fromkeys(s.role for s in self.segments if s.calls))

    def extendable(self, role: str, text: str) -> Segment | None:
        """The newest idle segment of ``role`` whose key ``text`` starts with, or None."""
        for segment in reversed(self.segments):
            if segment.role == role and segment.calls and not segment.pending and text.startswith(segment.key):
                return segment
        return None

    def trained_segments(self, frozen_roles: Collection[str] = ()) -> list[Segment]:
        """The segments with calls, in order, but those of ``frozen_roles`` (nothing trains on them)."""
        return [s for s in self.segments if s.calls and s.role not in frozen_roles]

    def samples(self, *, group_id: str, episode_id: str, routing: bool, sampling_mask: bool,
                frozen_roles: Collection[str] = ()) -> list[RolloutSample]:
        """One sample per trained segment (:meth:`trained_segments`; see the module docstring); rewards unset."""
        return [segment_sample(s, group_id=group_id, episode_id=episode_id, routing=routing,
                               sampling_mask=sampling_mask) for s in self.trained_segments(frozen_roles)]


def segment_sample(segment: Segment, *, group_id: str, episode_id: str, routing: bool,
                   sampling_mask: bool) -> RolloutSample:
    """The sample of one segment (module docstring); ``finish_reason`` the last call's."""
    if not segment.calls:
        raise ValueError(f"segment of role {segment.role!r} has no calls")
    prompt = segment.calls[0].sample.prompt_ids
    response: list[int] = []
    loss_mask, logprobs, versions, rows, turn_ends = [], [], [], [], []
    last_version: int | None = None
    for n, call in enumerate(segment.calls):
        s = call.sample
        done = len(prompt) + len(response)
        if s.prompt_ids[:done] != prompt + response:
            raise ValueError(f"call {n} of role {segment.role!r} was not fed the segment so far: its prompt differs "
                             f"within the first {done} tokens")
        between = s.prompt_ids[done:]
        if between:
            version = last_version if last_version is not None else int(s.model_version[0]) if len(s.model_version) \
                else 0
            response += between
            loss_mask.append(np.zeros(len(between), np.uint8))
            logprobs.append(np.zeros(len(between), np.float32))
            versions.append(np.full(len(between), version, np.int32))
            rows += [[token] for token in between]
        response += s.response_ids
        loss_mask.append(s.loss_mask)
        logprobs.append(s.rollout_logprobs)
        versions.append(s.model_version)
        if sampling_mask:
            rows += [s.sampling_mask.row(i).tolist() for i in range(len(s.response_ids))]
        if s.response_ids:
            last_version = int(s.model_version[-1])
        if call.turn_end and len(response) > (turn_ends[-1] if turn_ends else 0):
            turn_ends.append(len(response))
    last = segment.calls[-1].sample
    return RolloutSample(
        prompt_ids=list(prompt), response_ids=response, loss_mask=np.concatenate(loss_mask),
        rollout_logprobs=np.concatenate(logprobs), model_version=np.concatenate(versions),
        routed_experts=last.routed_experts if routing else None,
        sampling_mask=SamplingMask.from_rows(rows) if sampling_mask else None,
        finish_reason=last.finish_reason, group_id=group_id, episode_id=episode_id, turn_ends=tuple(turn_ends),
        role=segment.role, prefill_tokens=sum(c.sample.prefill_tokens for c in segment.calls),
        cached_tokens=sum(c.sample.cached_tokens for c in segment.calls),
    )
