"""What is asked and how an answer is scored: prompt sources and datasets (``prompts``), the demo's
arithmetic and calculator tasks (``arithmetic``, ``calculator``), the reward function's contract
(``reward_types``), the rule, remote and user rewards with their timeout-bounded scorer (``rewards``)
and the generative judge (``judge``, which reaches its engine through a call it is given). Nothing
of the engines."""
