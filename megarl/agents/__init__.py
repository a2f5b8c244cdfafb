"""Agent programs as RL episodes: an OpenAI-compatible gateway in front of the engines
(``gateway``, its response bodies in ``responses``, function calling in ``tools`` with the model's
tool-call parser named in ``parsers``), the recorded calls as samples (``trajectory``), and agent
functions run per episode (``rollout``; one call of the function, sync or async, in ``invoke``), loaded
from the name a config gives (``spec``), in the driver or in agent worker processes on any node
(``workers``); agent programs written with agent frameworks (``examples``)."""
