"""Rollout on the engines: one prompt -> a group of G scored samples (``group``: the
:class:`RolloutManager`, with rejected prompts and failed rewards counted), multi-turn environment
episodes (``env``), continuation splicing after an abort (``splice``) and the teacher's scores for
on-policy distillation (``teacher``)."""
