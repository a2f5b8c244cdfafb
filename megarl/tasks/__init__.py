"""What is asked and how an answer is scored: prompt sources and datasets (``prompts``), held-out prompts
(``heldout``), the demo's arithmetic, calculator and tool-calling tasks (``arithmetic``, ``calculator``,
``tool_calling``), the reward function's contract (``reward_types``), the rule, remote and user rewards
with their timeout-bounded scorer (``rewards``) and the generative judge (``judge``, which reaches its
engine through a call it is given). Nothing of the engines."""
