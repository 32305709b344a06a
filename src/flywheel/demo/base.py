"""The demo's first production model: a tiny model taught the week-1 family (add, with the calc
tool) by SFT on scripted episodes, built once and cached (first-time setup): a 64-hidden,
2-layer, 4-head model (with 4 heads the digit copying into and out of the tool call is
learnable in this budget; with 2 it was not).

It stands in for a pretrained model, so what it learns has to be the general skill: copy the
question's numbers into the call and the tool's result into the answer. Taught only 2-3 digit
additions, it learns a 4-digit result's leading "1" as a constant and later families stall;
so its demos mix additions of 1-2, 2-3 and 3-4 digit numbers (`digits`), which teaches it to
copy any 4-digit result. Its questions come in the eight phrasings of ADD_PHRASINGS, so that it
copies numbers from wherever a question puts them. It never sees "minus" or "times". The probes behind these choices
are in docs/benchmarks.md ("Measurements behind choices in the code").

Two prompt formats, one answer: `tools_share` of the demos offer the calc tool's schema with
the question (the calculator env with `system_prompt=False`: exactly the request of an OpenAI
client passing `tools=` with no system message), the rest ask the question bare (the demo's and
the loop walkthrough's traffic). Both are rendered by the model's own chat template, as the
server renders a request: the "compact" template (models/chat_template_compact.jinja), whose
tools block is one signature line, `calc(expression: string)`, about 45 byte tokens instead
of about 650, so tool-offering rows stay within the small SFT budget. The assistant turns
are the same in both, so a client passing `tools=` gets `tool_calls` parsed by the server.

The copying is learned abruptly, and whether it is learned within the step budget depends on
the order of the demos (`seed`), not on the tools rows; the default `seed` is the order that
learned on the machine these were measured on, and another machine's float rounding may land
elsewhere (tests/integration/test_demo_base_client_tools.py would tell). A model trained on
long after the jump was rigid (the demo's cycles gained little on a new family), so SFT stops
at the first check where held-out success reaches `stop_at`. The figures behind these choices
are in docs/benchmarks.md ("Demo base: demo order, tools rows and stopping").
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from flywheel import locations
from flywheel.demo.world import ENV, FAMILIES
from flywheel.envs.splits import SPLIT_RULE


# Ways to ask for an addition, the numbers at different places in each: a base taught only
# "What is {a} + {b}?" copies digits from where that template puts them, and garbles the
# second number of a question that puts it elsewhere ("What is {a} minus {b}?"; README, "The
# flagship demo"). A pretrained model reads numbers wherever they are; these stand in for
# that. None says "minus", "times" or another operation: the new families stay new.
ADD_PHRASINGS = ("What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?",
                 "Compute {a} + {b}.", "{a} + {b} = ?", "How much is {a} plus {b}?", "Please add {b} to {a}.")


@dataclass(frozen=True)
class BaseRecipe:
    """How the demo's base model is built: the tiny model's shape, its scripted SFT data and the
    SFT run. The hash of these fields names the model's cache folder (`key`)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 256
    demos: int = 4500  # scripted episodes of the week-1 family
    steps: int = 3000  # SFT steps
    batch: int = 16  # SFT batch size (no accumulation)
    lr: float = 3e-3
    warmup: int = 30
    family: dict[str, Any] = field(default_factory=lambda: FAMILIES[0].settings)  # calculator settings of the demos
    digits: tuple[int, ...] = (2, 3, 4)  # calculator max_digits of the demos, split evenly
    phrasings: tuple[str, ...] = ADD_PHRASINGS  # question templates of the demos, split evenly (see ADD_PHRASINGS)
    template: str = "compact"  # the model's chat template (models/tiny.py TEMPLATES)
    tools_share: float = 0.5  # of the demos: offered the calc schema, as a client's `tools=` is
    seed: int = 2  # which demos offer tools, and their order in the file (see the module docstring)
    stop_at: float = 0.95  # SFT stops at the first check (every 250 steps) where `_heldout` reaches it
    split_rule: str = SPLIT_RULE  # how the env puts a problem on train or test (envs/splits.py)

    def key(self) -> str:
        """12 hex digits of the SHA-256 of the fields as sorted JSON: the cache folder's name.
        A recipe that builds another model has another key; the same fields, the same key."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


BASE_RECIPE = BaseRecipe()


def base_demos(final: Path) -> Path:
    """The SFT rows the base model at `final` (what base_model returned) was trained on."""
    return Path(final).parent.parent / "demos.jsonl"


def base_model(recipe: BaseRecipe | None = None, root: Path | None = None,
               log: Callable[[str], None] = print) -> Path:
    """The cached base model folder for `recipe` (default BASE_RECIPE), built if missing."""
    from flywheel.config import SFTConfig, validate
    from flywheel.models import TinySpec, build_tiny_model
    from flywheel.train.sft import run_sft

    recipe = recipe or BASE_RECIPE
    root = (root or locations.cache_dir()) / f"demo-base-{recipe.key()}"
    final = root / "sft" / "final"
    if (final / "config.json").exists():
        return final
    log(f"first-time setup: building the demo's base model in {root} (at most {recipe.steps} SFT steps: "
        f"it stops once {recipe.stop_at:.0%} of held-out additions come out right)")
    root.mkdir(parents=True, exist_ok=True)
    tiny = root / "tiny"
    if not (tiny / "config.json").exists():
        build_tiny_model(tiny, TinySpec(hidden=recipe.hidden, layers=recipe.layers, heads=recipe.heads,
                                        ffn=recipe.ffn, template=recipe.template))
    demos = root / "demos.jsonl"
    _addition_demos(recipe, demos)
    run_sft(validate(dict(model=str(tiny), output_dir=str(root / "sft"), resume=True,
                          data={"train": [str(demos)], "format": "chat"},
                          train={"steps": recipe.steps, "batch_size": recipe.batch, "micro_batch_size": recipe.batch},
                          optim={"lr": recipe.lr, "warmup_steps": recipe.warmup, "min_lr_ratio": 0.1,
                                 "weight_decay": 0.01},
                          eval={"every": 250, "stop_at": {"eval/success": recipe.stop_at}},
                          checkpoint={"every": 250}, log={"progress": True}), SFTConfig),
            evaluator=_heldout(recipe), log=lambda m: None)
    return final


def _heldout(recipe: BaseRecipe, tasks: int = 40) -> Callable[[object, object], dict]:
    """SFT evaluator: greedy success on `tasks` 2-3 digit additions asked bare and as many asked
    with the calc schema offered, the lower of the two as "success". Train-side problems of a
    seed no demo is drawn from (demos: seeds 0 to len(digits) x len(phrasings) - 1), so the test
    split stays out of every choice."""
    from flywheel.envs import load_env
    from flywheel.train.env_eval import heldout_success

    settings = {**recipe.family, "max_digits": 3}
    formats = [heldout_success(load_env(ENV, **{**settings, **extra}), tasks=tasks, max_tokens=120, split="train",
                               seed=100) for extra in ({}, {"bare_prompt": False, "system_prompt": False})]

    def evaluate(model, tokenizer) -> dict:
        return {"success": min(f(model, tokenizer)["success"] for f in formats)}

    return evaluate


def addition_demos(recipe: BaseRecipe) -> list[dict]:
    """`recipe.demos` scripted episodes of the week-1 family as SFT rows, split evenly over the
    operand sizes in `recipe.digits` (calculator `max_digits`) and the question templates in
    `recipe.phrasings`, shuffled. A row is
    {"messages": [user, assistant(tool_calls), tool, assistant]} plus, in `recipe.tools_share`
    of them (seeded), "tools": [the calc schema] (what `flywheel env show calculator` prints).
    No row has a system message."""
    from flywheel.envs import load_env
    from flywheel.rollout.demos import make_demos

    kinds = [(digits, phrasing) for digits in recipe.digits for phrasing in recipe.phrasings]
    rng = random.Random(recipe.seed)
    rows: list[dict] = []
    for i, (digits, phrasing) in enumerate(kinds):
        n = recipe.demos // len(kinds) + (i < recipe.demos % len(kinds))
        env = load_env(ENV, **{**recipe.family, "max_digits": digits, "template": phrasing, "bare_prompt": False,
                               "system_prompt": False})
        for row in make_demos(env, n, seed=i)[0]:
            rows.append(row if rng.random() < recipe.tools_share else {"messages": row["messages"]})
    rng.shuffle(rows)
    return rows


def _addition_demos(recipe: BaseRecipe, out: Path) -> None:
    """`addition_demos(recipe)` as JSONL at `out`."""
    out.write_text("".join(json.dumps(r) + "\n" for r in addition_demos(recipe)), encoding="utf-8")
