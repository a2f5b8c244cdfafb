"""A run's start-up in four parts, composed by :func:`megarl.pipeline.run.open_pipeline`: the engines'
settings, launch and readiness (``engines``), the trainer ranks and what a resume restores
(``trainer``), the weight sync between them (``sync``), and the rollout that feeds the buffer:
prompts, rewards, judge, teacher, episodes, producer (``rollout``); the ranks and engines placed and
started in order (``placement``). Each builder puts what it starts into the caller's exit stack."""
