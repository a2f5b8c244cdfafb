"""megarl: Megatron-native RL post-training for large Mixture-of-Experts LLMs.

Its packages, lowest layer first (docs/architecture.md, "Packages"): the rollout sample (``sample``),
logging (``log``), start-up imports with the collector paused (``gc_pause``), processes that end with
what started them (``lifetime``), layouts and rendezvous
(``parallel``), the machine and its CPU work-arounds (``platform``), metrics (``metrics``), config fields
(``fields``), what crosses into the engines' processes (``wire``); algorithms (``algos``) and tasks
(``tasks``); models (``models``) and the code inside SGLang's processes (``engine_process``); the engines
from the driver's side (``engines``); rollout (``rollout``) and agents (``agents``); weight sync
(``sync``); the run config (``config``); the trainer (``trainer``); the planner (``planner``); the run's
wiring (``pipeline``); the entry points (``train``, ``plan``) and the placement rehearsal (``rehearsal``).
"""
