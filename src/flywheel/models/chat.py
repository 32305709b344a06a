"""Token-in-token-out conversation rendering.

A multi-turn rollout must never re-tokenize its history: the ids a policy sampled are the
ids it is trained on. `Conversation` therefore grows by appending ids:

- non-assistant turns (system, user, tool) are rendered with the tokenizer's own chat
  template, and only the *new text* the template produces for them is encoded and appended;
- assistant turns are appended as the exact sampled ids (ending with the end-of-turn token),
  and marked in `assistant_mask`, the loss mask of SFT and RL.

For a tokenizer whose encoding of the rendered text is canonical (the tiny byte-level
tokenizer, and any BPE when pieces meet at special tokens) the ids equal
`encode(render(messages))` of the finished conversation; tests check this.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import orjson

from flywheel.types import Message


ENCODE_MEMO = 256  # texts whose ids a ChatRenderer remembers (a group's members are played side by side)


class ChatTemplateError(ValueError):
    """The chat template cannot be rendered incrementally for these messages."""


class ToolsNotRendered(ChatTemplateError):
    """Tools were given, and the chat template has no place for them: the model would never
    see them. Raised by every render, so neither a request nor a rollout drops them silently."""

    def __init__(self):
        super().__init__("this model's chat template renders no tools, so the model would never see them; serve a "
                         "folder made by `flywheel model import`, which supplies a tools template for known "
                         "families, or describe the tools in a system message")


class ChatRenderer:
    """Renders messages through a Hugging Face tokenizer's chat template."""

    def __init__(self, tokenizer, memo_size: int = 4096):
        """memo_size: renders remembered (keyed by the messages' JSON); the episodes of a GRPO
        group open with the same messages, so most of their renders repeat. 0 = off (for a
        template whose output changes over time, e.g. one that prints today's date)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "the tokenizer has no chat_template; chat-format data needs one "
                "(use prompt/completion data, or a model folder with a template)"
            )
        self.tokenizer = tokenizer
        self.eos_token: str = tokenizer.eos_token
        self.memo_size = memo_size
        self._memo: OrderedDict[bytes, str] = OrderedDict()
        self._memo_lock = threading.Lock()  # rollouts render from asyncio's worker threads too
        # encodings of recent texts (text -> ids): the same pieces recur across a batch of
        # episodes, e.g. the generation prompt every turn, a group's shared opening messages
        self._encoded: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def render(self, messages: Sequence[Message], tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = False) -> str:
        """The template's text; ToolsNotRendered when `tools` are given and it has no place for them."""
        if tools and not self.renders_tools:
            raise ToolsNotRendered()
        key = self._memo_key(messages, tools, add_generation_prompt)
        if key is not None:
            with self._memo_lock:
                text = self._memo.get(key)
                if text is not None:
                    self._memo.move_to_end(key)
                    return text
        text = self.tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        if key is not None:
            with self._memo_lock:
                self._memo[key] = text
                if len(self._memo) > self.memo_size:
                    self._memo.popitem(last=False)
        return text

    def _memo_key(self, messages, tools, add_generation_prompt: bool) -> bytes | None:
        """The render's key in the memo; None when the memo is off or the messages are not JSON
        (objects a template formats itself): then they are rendered every time."""
        if not self.memo_size:
            return None
        try:
            return orjson.dumps([messages, tools or None, add_generation_prompt])
        except TypeError:
            return None

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no special tokens added), a fresh list. Remembered for the last
        ENCODE_MEMO texts: encoding is a pure function of the text."""
        if not text:
            return []
        with self._memo_lock:
            ids = self._encoded.get(text)
            if ids is not None:
                self._encoded.move_to_end(text)
                return list(ids)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        with self._memo_lock:
            self._encoded[text] = tuple(ids)
            if len(self._encoded) > ENCODE_MEMO:
                self._encoded.popitem(last=False)
        return ids

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the template shows a request's tools to the model (a probe tool's unique name
        must appear in the rendered prompt). A template without a tools section would drop
        them without a word."""
        probe = "flywheel_probe_tool_7f3a"
        tool = {"type": "function", "function": {"name": probe, "description": "", "parameters": {"type": "object"}}}
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool],
                                                      tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            return False
        return probe in text

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        """Ids of `messages` followed by the assistant generation prompt."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def start(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> "Conversation":
        conv = Conversation(self, tools=list(tools) if tools else None)
        conv.append_messages(messages)
        return conv

    def split_assistant_turn(self, before: str, after: str) -> tuple[str, str]:
        """Split the template's rendering of one assistant turn into (text the model produces,
        trailing text the template adds after it), e.g. ("42<|im_end|>", "\\n") for ChatML,
        from two renders: `before`, the history with the generation prompt, and `after`, the
        history with the assistant message."""
        if not after.startswith(before):
            raise ChatTemplateError("the chat template does not render the assistant turn "
                                    "as a continuation of the generation prompt")
        turn = after[len(before):]
        cut = turn.rfind(self.eos_token)
        if cut < 0:
            raise ChatTemplateError(f"the rendered assistant turn has no end token {self.eos_token!r}")
        cut += len(self.eos_token)
        return turn[:cut], turn[cut:]


@dataclass
class Conversation:
    """A conversation as token ids. `assistant_mask[i]` is 1 where token i was produced by
    the assistant and is trained on (content, tool calls and the end-of-turn token)."""

    renderer: ChatRenderer
    tools: list[dict] | None = None
    messages: list[Message] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    assistant_mask: list[int] = field(default_factory=list)
    _text: str = ""            # what the template rendered for `messages` so far
    _pending_tail: str = ""    # template text owed after the last assistant turn (e.g. "\n")
    _open_prompt: bool = False  # the generation prompt is already in `ids`

    def _push(self, ids: list[int], mask_value: int) -> None:
        self.ids.extend(ids)
        self.assistant_mask.extend([mask_value] * len(ids))

    def append_messages(self, messages: Sequence[Message]) -> None:
        """Append messages. A run of consecutive system / user / tool messages is rendered
        together (templates merge consecutive tool results into one turn); assistant
        messages given as text are rendered by the template (use `append_sampled` for ids)."""
        run: list[Message] = []
        for m in messages:
            if m.get("role") == "assistant":
                self._append_run(run)
                run = []
                self.append_assistant_message(m)
            else:
                run.append(m)
        self._append_run(run)

    def _append_run(self, run: list[Message]) -> None:
        if not run:
            return
        if self._open_prompt:
            raise ChatTemplateError("cannot add a non-assistant message after the generation prompt")
        new_text = self.renderer.render([*self.messages, *run], self.tools)
        if not new_text.startswith(self._text):
            raise ChatTemplateError(
                f"the chat template re-renders earlier turns when {[m.get('role') for m in run]} "
                "messages are added, so the conversation cannot be built token by token")
        self._push(self.renderer.encode(self._pending_tail + new_text[len(self._text):]), 0)
        self._pending_tail = ""
        self.messages.extend(dict(m) for m in run)
        self._text = new_text

    def add_generation_prompt(self) -> list[int]:
        """Append the assistant header (e.g. "<|im_start|>assistant\\n"); returns all ids,
        which is the prompt to sample the next assistant turn from."""
        if not self._open_prompt:
            text = self.renderer.render(self.messages, self.tools, add_generation_prompt=True)
            if not text.startswith(self._text):
                raise ChatTemplateError("the generation prompt is not a continuation of the conversation")
            self._push(self.renderer.encode(self._pending_tail + text[len(self._text):]), 0)
            self._pending_tail = ""
            self._text = text
            self._open_prompt = True
        return list(self.ids)

    def append_sampled(self, sampled_ids: Sequence[int], message: Message, trained: bool = True) -> None:
        """Append an assistant turn exactly as sampled (ids should end with the end-of-turn
        token); `message` is its parsed form (content, tool_calls) for the history."""
        self.add_generation_prompt()
        self._push(list(sampled_ids), 1 if trained else 0)
        self._close_assistant(message)

    def append_assistant_message(self, message: Message, trained: bool = True) -> None:
        """Append an assistant turn given as a message (SFT data): its text comes from the
        template. `trained=False` (OpenAI `"weight": 0`) keeps it out of the loss."""
        self.add_generation_prompt()
        produced = self._close_assistant(message)
        self._push(self.renderer.encode(produced), 1 if trained else 0)

    def _close_assistant(self, message: Message) -> str:
        """Record `message` after the open generation prompt; returns the text the template
        gives the turn up to its end token. One render: the generation prompt's rendering
        is `_text` already, and the rendering with the message is the new `_text`."""
        after = self.renderer.render([*self.messages, message], self.tools)
        produced, tail = self.renderer.split_assistant_turn(self._text, after)
        self.messages.append(dict(message))
        self._text = after
        self._pending_tail = tail
        self._open_prompt = False
        return produced

    def finish(self) -> None:
        """Append any text the template owes after the last turn (e.g. ChatML's newline)."""
        if self._pending_tail:
            self._push(self.renderer.encode(self._pending_tail), 0)
            self._pending_tail = ""
