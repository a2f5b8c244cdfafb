"""Agent programs for ``task.agent`` (the contract: ``megarl/agents/rollout.py``): written with agent frameworks,
the OpenAI Agents SDK (``agents_sdk_add``), and a tool-heavy stand-in (``cpu_tool``)."""
