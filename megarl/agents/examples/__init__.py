"""Agent programs for ``task.agent``: written with agent frameworks, and a tool-heavy stand-in (the contract:
``megarl/agents/rollout.py``)."""
