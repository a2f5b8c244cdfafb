"""Agent programs for ``task.agent`` written with agent frameworks (the contract: ``megarl/agents/rollout.py``):
the OpenAI Agents SDK (``agents_sdk_add``)."""
