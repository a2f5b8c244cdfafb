"""Agent programs as RL episodes: an OpenAI-compatible gateway in front of the engines
(``gateway``, its response bodies in ``responses``, function calling in ``tools`` with the model's
tool-call parser named in ``parsers``), the recorded calls as samples (``trajectory``), and agent
functions run per episode (``rollout``), loaded from the name a config gives (``spec``); agent programs
written with agent frameworks (``examples``)."""
