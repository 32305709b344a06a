"""DPO data: JSONL in the OpenAI preference fine-tuning format, one pair per line:

    {"input": {"messages": [...], "tools": [...]},
     "preferred_output": [{"role": "assistant", "content": ...}],
     "non_preferred_output": [{"role": "assistant", "content": ...}]}

Each side is rendered with the chat template as the input conversation followed by its
assistant turn (turn by turn, `Conversation`); the loss covers the assistant tokens. Bad
lines raise `DataError` naming file:line, or are skipped with a warning each (`on_error=skip`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flywheel.config import DPODataConfig
from flywheel.models.chat import ChatRenderer, ChatTemplateError
from flywheel.train.sft_data import DataError


@dataclass
class PreferencePair:
    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    source: str


def load_pairs(paths: list[str], tokenizer, cfg: DPODataConfig,
               log: Callable[[str], None] = print) -> tuple[list[PreferencePair], int]:
    """(pairs, skipped lines)."""
    renderer = ChatRenderer(tokenizer)
    pairs, skipped = [], 0
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"{path}: no such file")
        for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                pair = _pair(json.loads(line), renderer, where)
                if max(len(pair.chosen_ids), len(pair.rejected_ids)) > cfg.max_length:
                    raise DataError(f"{where}: longer than max_length {cfg.max_length}; skipped")
                pairs.append(pair)
            except (json.JSONDecodeError, DataError, ChatTemplateError) as e:
                msg = f"{where}: invalid JSON: {e.msg} (column {e.colno})" if isinstance(e, json.JSONDecodeError) \
                    else str(e)
                if cfg.on_error == "raise" and "max_length" not in msg:
                    raise DataError(msg) from None
                skipped += 1
                log(f"warning: {msg}")
    if not pairs:
        raise DataError(f"no preference pairs in {', '.join(paths)}")
    return pairs, skipped


def _pair(row, renderer: ChatRenderer, where: str) -> PreferencePair:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object")
    inp = row.get("input")
    if not isinstance(inp, dict) or not isinstance(inp.get("messages"), list) or not inp["messages"]:
        raise DataError(f"{where}: 'input.messages' must be a non-empty list of messages")
    tools = inp.get("tools") or None
    sides = []
    for key in ("preferred_output", "non_preferred_output"):
        out = row.get(key)
        if not isinstance(out, list) or len(out) != 1 or not isinstance(out[0], dict) \
                or out[0].get("role") != "assistant":
            raise DataError(f"{where}: {key!r} must be a list holding one assistant message")
        if not out[0].get("content") and not out[0].get("tool_calls"):
            raise DataError(f"{where}: {key!r} has neither content nor tool_calls")
        conv = renderer.start(inp["messages"], tools)
        conv.append_assistant_message(out[0])
        sides.append((list(conv.ids), list(conv.assistant_mask)))
    (ci, cm), (ri, rm) = sides
    return PreferencePair(ci, cm, ri, rm, where)
