"""A multi-turn code-repair environment whose every model turn goes through `verifiers` to `das serve`, unchanged.

verifiers 0.4.0 (its `verifiers.v1` stack) replaced `MultiTurnEnv` / `ToolEnv` with harness programs that an
interception server proxies; every model turn of that stack ends in a `Client.get_response(dialect, body, ...)`
call. That is the layer used here, in process: `vf.resolve_client(EvalClientConfig)` (verifiers' provider client)
with `ChatDialect` (its OpenAI chat wire format), verifiers' message types, and the environment's step between
turns (run the task's tests, hand the failures back as the next user turn), as a MultiTurnEnv's `env_response`
did. vLLM's and the service's fields ride in the request body as the OpenAI client's `extra_body` would put them:
`session_id` (the trajectory: its turns stay on the engine holding its prefix), `problem_id` (the task: epochs
draft from each other), `return_token_ids`, and a per-turn `seed` (keyed sampling: reruns draw the same tokens).
verifiers' own `X-Session-ID` routing header goes along too. Each turn's `prompt_token_ids` and `token_ids` come
back on the reply (`Response.raw`) and are collected for training, with the reward (1 when the tests pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import verifiers.v1 as vf
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.dialects.chat import message_to_wire

from das.service.client.code_checks import check_code
from das.service.client.code_tasks import CODE_SYSTEM_PROMPT, CODE_TASKS
from das.service.wire.sample_keys import derive


@dataclass(frozen=True)
class AgentConfig:
    """`tasks`: the first N bundled code tasks, one trajectory each; `turns`: the most model turns of one;
    `max_tokens`: per turn; `tool_timeout_s`: wall-clock limit of one test run."""

    base_url: str
    tasks: int = 2
    turns: int = 3
    max_tokens: int = 256
    temperature: float = 0.7
    seed: int = 0
    tool_timeout_s: float = 10.0
    api_key: str = "none"


@dataclass
class TrainingTurn:
    """What a trainer takes from one turn: the prompt the engine saw and the tokens it produced (no re-tokenizing)."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]


@dataclass
class Rollout:
    """One task's trajectory: its messages, its turns as token ids, and its reward."""

    task: str
    messages: list[vf.Message] = field(default_factory=list)
    turns: list[TrainingTurn] = field(default_factory=list)
    reward: float = 0.0


def _token_ids(raw: dict) -> TrainingTurn:
    choice = raw["choices"][0]
    prompt = raw.get("prompt_token_ids") or choice.get("prompt_token_ids")
    if prompt is None or choice.get("token_ids") is None:
        raise RuntimeError("the server returned no token ids (is it das serve, with return_token_ids?)")
    return TrainingTurn(list(prompt), list(choice["token_ids"]))


async def rollout(client: vf.Client, config: AgentConfig, task_index: int) -> Rollout:
    """The code-repair loop for one task: reply, run the tests, hand the failures back, up to `config.turns`."""
    name, signature = CODE_TASKS[task_index]
    result = Rollout(name, [vf.SystemMessage(content=CODE_SYSTEM_PROMPT), vf.UserMessage(content=signature)])
    session_id = f"vf-{name}-{config.seed}"
    dialect = ChatDialect()
    for turn in range(config.turns):
        sampling = vf.SamplingConfig(temperature=config.temperature, max_tokens=config.max_tokens,
                                     seed=derive(derive(config.seed, task_index), turn),
                                     extra_body={"session_id": session_id, "problem_id": f"code/{name}",
                                                 "return_token_ids": True})
        body = {"model": "das", "messages": [message_to_wire(m) for m in result.messages],
                **sampling.model_dump(exclude_none=True)}
        response = await client.get_response(dialect, body, sampling, session_id=session_id)
        result.turns.append(_token_ids(response.raw or {}))
        result.messages.append(response.message)
        check = await check_code(name, response.message.content or "", config.tool_timeout_s)
        if check.passed:
            result.reward = 1.0
            break
        result.messages.append(vf.UserMessage(content=f"The tests failed:\n{check.feedback}\nFix the function; "
                                                      "reply with the whole function in one Python code block."))
    return result


async def run_agent(config: AgentConfig) -> list[Rollout]:
    """All tasks' trajectories at once, through one verifiers client."""
    import asyncio
    import os

    os.environ["DAS_VF_API_KEY"] = config.api_key  # verifiers reads the key from the variable it names
    client = vf.resolve_client(vf.EvalClientConfig(base_url=f"{config.base_url}/v1", api_key_var="DAS_VF_API_KEY"))
    try:
        return list(await asyncio.gather(*(rollout(client, config, i) for i in range(config.tasks))))
    finally:
        await client.close()
