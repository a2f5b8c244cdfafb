"""The Megatron trainer: ranks as Ray actors and their launch (``actor``, ``launch``, ``rank_pool``),
process groups and devices (``distributed``, ``device``), model set-up and optimizer (``model_setup``,
``optimizer``), batches and micro-batches (``token_batch``, ``rl_batch``, ``micro_batching``, ``packing``,
``context_parallel``), log-probs, the RL and supervised steps and the warm-up (``logprobs``, ``rl_step``,
``sft_step``, ``warmup``), Keep Routing's replay (``routing_replay``), the experts' load
(``expert_load``), score centering's inputs (``score_support``), the critic (``critic``), the reference
policy (``reference``), train-inference mismatch (``mismatch``), checkpoints and HF conversion
(``checkpoint``, ``save_results_queue``, ``convert``); its config sections (``settings``)."""
