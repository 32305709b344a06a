"""A Policy backed by a local model: each episode is one token-level Conversation (the ids
sampled are the ids kept), so multi-turn play never re-tokenizes its history."""

from __future__ import annotations

import asyncio

from flywheel.envs.base import Policy
from flywheel.models import ChatRenderer
from flywheel.types import Message, Task


class ModelPolicy(Policy):
    def __init__(self, engine, params):
        self.engine, self.params = engine, params
        self.renderer = ChatRenderer(engine.tokenizer) if engine.tokenizer.chat_template else None
        self._episodes: dict[int, tuple] = {}  # episode -> (Conversation, messages consumed)

    async def end_episode(self, episode: int) -> None:
        self._episodes.pop(episode, None)

    async def act(self, task: Task, history: list[Message] | str, tools: list[dict] | None,
                  episode: int = 0) -> str:
        if isinstance(history, str):  # raw completion
            sample = await self._sample(self.engine.encode(history))
            return sample.text
        if self.renderer is None:
            raise ValueError("this model has no chat template; chat tasks need one")
        conv, consumed = self._episodes.get(episode, (None, 0))
        if conv is None:
            conv = self.renderer.start(history, tools)
        else:
            conv.append_messages(history[consumed + 1:])  # skip the assistant turn we produced
        sample = await self._sample(conv.add_generation_prompt())
        conv.append_sampled(sample.token_ids, {"role": "assistant", "content": sample.text})
        self._episodes[episode] = (conv, len(history))
        return sample.text

    async def _sample(self, prompt_ids: list[int]):
        (sample,), = await asyncio.to_thread(self.engine.generate, [prompt_ids], self.params)
        return sample
