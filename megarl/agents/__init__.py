"""Agent programs as RL episodes: an OpenAI-compatible gateway in front of the engines
(``gateway``), the recorded calls as samples (``trajectory``), and agent functions run per episode
(``rollout``), loaded from the name a config gives (``spec``)."""
