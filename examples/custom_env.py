"""A custom tool-using environment in one file: stock questions answered from an inventory
the model can only reach through its tools.

    flywheel env show examples.custom_env:load
    flywheel env try examples.custom_env:load -k 2              # scripted policy, from the repo root
    flywheel rl examples/custom_env_grpo.yaml model=runs/tiny   # GRPO on it (docs/envs.md)

The task: "How many units of blue anvil are in stock?". The counts live in a warehouse
database the model never saw, so it has to call `search` (item name -> SKU) and then
`stock` (SKU -> units per warehouse) and add them up. The verifier gives reward 1 when the
last number of the final answer is the total; `used_tools` (both tools called) is logged as
a weight-0 metric. Items of the test split are never asked in training, so held-out success
measures tool use, not memory.

Everything an environment needs is here: tools from plain functions (their JSON schemas come
from the signatures and docstrings), a rubric, limits, tasks, a scripted policy for smoke
tests, and `load`, the function the registry calls with the settings.
"""

from __future__ import annotations

import json
import random
import re

from flywheel.envs import Environment, Rubric, tool
from flywheel.envs.base import Env, Policy
from flywheel.envs.rubric import EpisodeState, RewardFn
from flywheel.envs.tool_env import ToolEnv, ToolLimits
from flywheel.types import Task

# ---------------------------------------------------------------- the world the tools see

COLOURS = ("red", "blue", "green", "black", "white", "yellow", "grey", "orange")
THINGS = ("anvil", "bolt", "crate", "drill", "funnel", "hammer", "ladder", "pulley", "rope", "wrench")
WAREHOUSES = ("north", "south")


def _inventory() -> dict[str, dict]:
    """SKU -> {"name", "units": {warehouse: count}}; fixed by a seed, 80 items."""
    rng = random.Random("inventory")
    items = {}
    for i, (colour, thing) in enumerate((c, t) for c in COLOURS for t in THINGS):
        items[f"SKU-{1000 + i}"] = {"name": f"{colour} {thing}",
                                    "units": {w: rng.randrange(0, 60) for w in WAREHOUSES}}
    return items


INVENTORY = _inventory()


@tool(blocking=False)  # cheap and pure: run on the event loop, not in a worker thread
def search(query: str) -> list[dict]:
    """Find catalog items whose name contains the query.

    Args:
        query: words of the item's name, e.g. "blue anvil".
    """
    words = query.lower().split()
    hits = [{"sku": sku, "name": it["name"]} for sku, it in INVENTORY.items()
            if words and all(w in it["name"] for w in words)]
    return hits[:5]


@tool(blocking=False, timeout_s=5.0)
def stock(sku: str) -> dict:
    """Units of an item in stock, per warehouse.

    Args:
        sku: the item's SKU as `search` returns it, e.g. "SKU-1012".
    """
    if sku not in INVENTORY:
        raise KeyError(f"no item with SKU {sku!r}; use search to find it")  # the model sees this as a tool error
    return dict(INVENTORY[sku]["units"])


# ---------------------------------------------------------------- the verifier

_NUMBER = re.compile(r"-?\d+")


def correct(state: EpisodeState) -> float:
    """1 if the last number of the final answer (the turn without tool calls) is the total."""
    numbers = _NUMBER.findall(state.final_text)
    return float(bool(numbers) and numbers[-1] == state.task.answer)


def used_tools(state: EpisodeState) -> float:
    return float({"search", "stock"} <= {c.name for c in state.tool_calls})


# ---------------------------------------------------------------- the environment

SYSTEM = "You answer stock questions. Use the search and stock tools, then give the total as a number."


class InventoryEnvironment(Environment):
    name = "inventory"
    description = "stock questions answered with search + stock tools over an unseen inventory"

    def __init__(self, limits: ToolLimits = ToolLimits(max_turns=4), bare_prompt: bool = False):
        self.limits, self.bare_prompt = limits, bare_prompt
        self.tools = [search, stock]
        self.rubric = Rubric([RewardFn(correct, weight=1.0, inline=True),
                              RewardFn(used_tools, weight=0.0, inline=True)])  # weight 0: a metric only

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        skus = sorted(INVENTORY)
        random.Random("inventory-split").shuffle(skus)
        chosen = skus[:16] if split == "test" else skus[16:]  # 16 held-out items, 64 for training
        if n is not None and n < len(chosen):
            chosen = random.Random(seed).sample(chosen, n)
        out = []
        for sku in chosen:
            item = INVENTORY[sku]
            question = {"role": "user", "content": f"How many units of {item['name']} are in stock?"}
            system = {"role": "system", "content": SYSTEM}
            out.append(Task(id=f"inventory-{split}-{sku}", split=split, answer=str(sum(item["units"].values())),
                            prompt=[question] if self.bare_prompt else [system, question],
                            tools=[] if self.bare_prompt else [t.schema for t in self.tools],
                            metadata={"sku": sku, "name": item["name"]}))
        return out

    def make_env(self, task: Task) -> Env:
        """One episode: ToolEnv parses tool calls (Hermes `<tool_call>{json}</tool_call>`), runs
        them, feeds results back, stops at a final answer or the limits, and scores it."""
        return ToolEnv(task, self.tools, self.rubric, self.limits)

    def scripted_policy(self) -> Policy:
        return ScriptedInventoryPolicy()

    def info(self) -> dict:
        return {**super().info(), "tools": [t.schema for t in self.tools], "max_turns": self.limits.max_turns,
                "bare_prompt": self.bare_prompt, "train_tasks": 64, "test_tasks": 16,
                "reward": "1 if the last number of the final answer is the total stock; metric used_tools"}


class ScriptedInventoryPolicy(Policy):
    """search -> stock -> the sum: what a good model does, for `flywheel env try` and tests."""

    async def act(self, task, history, tools, episode: int = 0) -> str:
        last = history[-1]
        if last["role"] != "tool":
            return _call("search", query=task.metadata["name"])
        result = json.loads(last["content"])
        if isinstance(result, list):  # search's answer
            return _call("stock", sku=result[0]["sku"])
        return f"There are {sum(result.values())} units in stock."


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def load(max_turns: int = 4, bare_prompt: bool = False) -> InventoryEnvironment:
    """What the registry calls for `examples.custom_env:load`; its keyword arguments are the
    settings (`--set max_turns=3`, or `env.settings` in a config). `bare_prompt` drops the
    system message and the tool schemas from the prompt (the tools still answer): ~60 tokens
    instead of ~1,100 with the tiny model's byte tokenizer, for a model already taught the tools."""
    if not isinstance(bare_prompt, bool):
        raise ValueError(f"bare_prompt must be true or false, got {bare_prompt!r}")
    return InventoryEnvironment(ToolLimits(max_turns=int(max_turns)), bare_prompt=bare_prompt)
