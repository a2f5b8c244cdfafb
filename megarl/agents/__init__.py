"""Agent programs as RL episodes: an OpenAI-compatible gateway in front of the engines
(``gateway``), the recorded calls as samples (``trajectory``), and agent functions run per episode
(``rollout``; one call of the function, sync or async, in ``invoke``), loaded from the name a config
gives (``spec``), in the driver or in agent worker processes on any node (``workers``)."""
