"""PrefixCache: keys and values of prompt prefixes kept across prefills (one engine, one
set of weights), so a server whose requests all start with the same system prompt and tool
schemas computes that prefix once, not once per request or per admitted group.

An entry is a 1-row `KVCache` of length L (layers, 2, 1, KV heads, L, head dim) holding the
keys and values of tokens[:L] at positions 0..L-1, computed by decode.py's prefill from the
engine's weights at the time, under its owner: None for the base model, a LoRA adapter's
`Resident.serial` for that adapter (its deltas change keys and values). It stays valid only
while those weights do: the engine clears the cache whenever its weights change (engine.py
`_updating`), and an adapter read again gets a new serial.

`longest(prompts, owner)` finds the owner's longest entry every prompt starts with and extends
by at least one token (that token's logits are the prefill's output). Entries are evicted least recently
used first once their bytes exceed `max_bytes`; an entry bigger than the budget is not kept.
Not thread-safe: the engine's lock guards every prefill and weight change.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from flywheel.inference.decoder import KVCache


class PrefixCache:
    def __init__(self, max_bytes: int):
        """max_bytes: keys and values kept, at most (0: the cache keeps nothing)."""
        if max_bytes < 0:
            raise ValueError(f"PrefixCache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[int | None, tuple[int, ...]], KVCache] = OrderedDict()  # oldest use first
        self.hits = 0  # prefills that reused an entry
        self.tokens_reused = 0  # prompt tokens not recomputed thanks to an entry (summed over prompts)

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, prompts: Sequence[Sequence[int]], owner: int | None = None) -> KVCache | None:
        """The owner's longest entry that is a prefix of every prompt, each prompt keeping >= 1
        token of its own; None if there is none. The entry counts as used (moved to the back)."""
        room = min(len(p) for p in prompts) - 1
        best: tuple[int | None, tuple[int, ...]] | None = None
        for key in self._entries:
            who, tokens = key
            L = len(tokens)
            if (who == owner and L <= room and (best is None or L > len(best[1]))
                    and all(tuple(p[:L]) == tokens for p in prompts)):
                best = key
        if best is None:
            return None
        self._entries.move_to_end(best)
        return self._entries[best]

    def put(self, tokens: Sequence[int], kv: KVCache, owner: int | None = None) -> None:
        """Keep `kv` (length len(tokens)) as the owner's keys and values of `tokens`."""
        key = (owner, tuple(tokens))
        if kv.length != len(key[1]):
            raise ValueError(f"a prefix of {len(key[1])} tokens with a cache of length {kv.length}")
        size = _nbytes(kv)
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = kv
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= _nbytes(old)

    def clear(self) -> None:
        """Forget every entry (the weights they were computed from changed)."""
        self._entries.clear()
        self.bytes = 0


def _nbytes(kv: KVCache) -> int:
    return kv.kv.element_size() * kv.kv.nelement()
