"""Agent functions for tests/test_agent_gateway.py, loaded by dotted path (``agent_examples:three_turns``).

Each follows megarl's agent contract (``megarl/agents/rollout.py``). ``prompt.metadata["log"]``, when
a test passes a list there, receives the messages of every chat call the agent made (in-driver episodes:
an agent worker's copy of the prompt does not come back). ``*_sync`` agents are plain functions on the
synchronous client."""
import asyncio
import threading
import time


def _log(prompt, messages):
    if "log" in prompt.metadata:
        prompt.metadata["log"].append([dict(m) for m in messages])


async def three_turns(client, prompt):
    """Three chat turns, each answered by a one-line tool result; reward 1.0."""
    messages = [{"role": "user", "content": prompt.text}]
    for turn in range(3):
        _log(prompt, messages)
        answer = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4,
                                                      temperature=0.7)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "tool", "content": str(turn)}]
    return 1.0


async def solver_and_verifier(client, prompt):
    """The solver answers, the verifier (its own conversation) checks the answer; a reward per role."""
    solution = await client.chat.completions.create(
        model="solver", messages=[{"role": "user", "content": prompt.text}], max_tokens=4)
    answer = solution.choices[0].message.content
    await client.chat.completions.create(
        model="verifier", messages=[{"role": "user", "content": f"{prompt.text}{answer}?"}], max_tokens=2)
    return {"solver": 1.0, "verifier": -0.5}


FROZEN_VERDICTS: list[tuple[list[dict], str]] = []  # the frozen verifier's (messages, answer); tests read them


async def solver_and_frozen_verifier(client, prompt):
    """As ``solver_and_verifier``, with the verifier a frozen model asked greedily: only the solver gets a
    reward."""
    solution = await client.chat.completions.create(
        model="solver", messages=[{"role": "user", "content": prompt.text}], max_tokens=4)
    messages = [{"role": "user", "content": f"{prompt.text}{solution.choices[0].message.content}?"}]
    verdict = await client.chat.completions.create(model="verifier", messages=messages, max_tokens=4,
                                                   temperature=0.0)
    FROZEN_VERDICTS.append((messages, verdict.choices[0].message.content))
    return {"solver": 1.0}


async def _one_call(client, prompt):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt.text}],
                                         max_tokens=2)


async def raises(client, prompt):
    await _one_call(client, prompt)
    raise ValueError("the agent lost its way")


async def hangs(client, prompt):
    await asyncio.sleep(3600)


async def returns_string(client, prompt):
    await _one_call(client, prompt)
    return "a good episode"


async def wrong_roles(client, prompt):
    await _one_call(client, prompt)
    return {"critic": 1.0}


async def silent(client, prompt):
    return 1.0


async def rewrites_history(client, prompt):
    """Two turns, the second with the first user message edited: the gateway opens a second segment."""
    messages = [{"role": "user", "content": prompt.text}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    messages = [{"role": "user", "content": prompt.text + " "},
                {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "?"}]
    _log(prompt, messages)
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    return 0.5


def three_turns_sync(client, prompt):
    """``three_turns`` as a plain function on the synchronous client."""
    messages = [{"role": "user", "content": prompt.text}]
    for turn in range(3):
        answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=4, temperature=0.7)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "tool", "content": str(turn)}]
    return 1.0


async def blocks_its_loop(client, prompt):
    """Blocks its event loop for ``prompt.metadata["block_s"]`` seconds (a blocking tool), then makes one call."""
    time.sleep(prompt.metadata.get("block_s", 0.0))
    await _one_call(client, prompt)
    return 1.0


def raises_sync(client, prompt):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt.text}], max_tokens=2)
    raise ValueError("the agent lost its way")


def hangs_sync(client, prompt):
    time.sleep(3600)


async def returns_a_lock(client, prompt):
    await _one_call(client, prompt)
    return threading.Lock()
