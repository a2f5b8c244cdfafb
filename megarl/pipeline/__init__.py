"""An RL run's wiring: the run's pipeline and its step (``run``), start-up in four parts (``startup``:
engines, trainer and resume, weight sync, rollout), the step's books (``bookkeeping``), the bounded
rollout buffer and its producer (``buffer``, ``producer``), the rollouts a checkpoint carries
(``carried``), the sample ledger (``ledger``), mode -> lag and buffer depth (``modes``), stop signals
(``signals``), colocated placement (``colocate``), the policy engines joining and leaving
(``membership``), the trainer nodes and ranks under watch (``node_watch``), the run directory as one
run's (``run_dir``), held-out evaluation (``evaluation``) and
the judge on its engine (``judge``)."""
