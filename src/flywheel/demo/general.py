"""General ability beside the demo's families: what training on narrow traffic costs the rest
(RL's Razor: the further a fine-tuned model's distribution moves from its base, the more it
forgets). Measured for a pretrained base only (a tiny model has no general ability to lose):

- the forward KL per token from the base to production on the base's own greedy answers to
  GENERAL_PROMPTS, everyday chat requests that none of the families resembles
  (demo/forgetting.py's measure: 0 for the base itself);
- SIMPLE_QUESTIONS the base answered right at the start, asked again at the end: the points
  lost are the share of them production no longer answers right.

Against that loss, `self_anchor` writes the base's own answers to other everyday prompts and
short questions (ANCHOR_PROMPTS, ANCHOR_QUESTIONS, none of them measured) for the cycles to
rehearse.

A question counts as answered right when the first sentence of its reply holds one of its
accepted answers as a whole word (case-insensitive): "1 year is 365 * 12 = 312 months" after
"A year is approximately 365 days." is wrong, as is "called Kepler-41B. It's ... similar to
Earth". Only questions the base got right are asked again, so the figure is a loss against the
base by construction, never a gain from luck.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

GENERAL_PROMPTS = (
    "Write a short greeting for a friend's birthday card.",
    "Give me three tips for sleeping better.",
    "What should I pack for a weekend trip to the beach?",
    "Explain what a rainbow is in two sentences.",
    "Suggest a name for a small orange cat.",
    "How do I make a cup of tea?",
    "Write one sentence about autumn.",
    "What is a good way to start learning to cook?",
    "Describe a dog to someone who has never seen one.",
    "Why do people enjoy music?",
    "Give me a simple idea for a rainy afternoon.",
    "What does a librarian do?",
    "Write a polite reply declining a meeting invitation.",
    "Tell me a fun fact about the ocean.",
    "How can I keep a houseplant healthy?",
    "What is the difference between a lake and a river?",
)

# (question, accepted answers): plain knowledge a small instruct model often has
SIMPLE_QUESTIONS = (
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What is the capital of Germany?", ("berlin",)),
    ("What is the capital of Spain?", ("madrid",)),
    ("What is the capital of England?", ("london",)),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What color is grass?", ("green",)),
    ("What color are ripe bananas?", ("yellow",)),
    ("What is the opposite of hot?", ("cold",)),
    ("What is the opposite of up?", ("down",)),
    ("What is the opposite of day?", ("night",)),
    ("How many legs does a spider have?", ("eight", "8")),
    ("How many days are in a week?", ("seven", "7")),
    ("How many months are in a year?", ("twelve", "12")),
    ("What animal says moo?", ("cow",)),
    ("What animal barks?", ("dog",)),
    ("Which planet do we live on?", ("earth",)),
    ("What is frozen water called?", ("ice",)),
    ("What do bees make?", ("honey",)),
    ("Which star is closest to the Earth?", ("sun",)),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("What language is spoken in Brazil?", ("portuguese",)),
    ("What gas do plants take in from the air?", ("carbon dioxide", "co2")),
    ("In which season do leaves fall from trees?", ("autumn", "fall")),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("What do you call a baby cat?", ("kitten",)),
    ("What do you call a baby dog?", ("puppy",)),
    ("What is the boiling point of water in Celsius?", ("100",)),
)
# The anchor's prompts: everyday requests of other shapes and topics than the measured ones
# above (a test holds them apart), whose answers by the base are rehearsed in every SFT stage
ANCHOR_TEMPLATES = ("Tell me something interesting about {}.", "Write two sentences about {}.",
                    "What should a beginner know about {}?", "Describe {} in simple words.",
                    "Give one practical tip about {}.", "Why might someone care about {}?")
ANCHOR_TOPICS = ("gardening", "the moon", "bicycles", "bread", "mountains", "libraries", "trains", "chess",
                 "the weather", "painting", "honeybees", "the internet", "running shoes", "volcanoes", "coffee",
                 "friendship")
ANCHOR_PROMPTS = tuple(t.format(topic) for topic in ANCHOR_TOPICS for t in ANCHOR_TEMPLATES)
# Short questions of plain knowledge, other facts than SIMPLE_QUESTIONS asks (a test holds them
# apart): everyday traffic holds short questions as well as requests for prose, and the
# cycles' narrow corrections made the base's short answers wordy (docs/benchmarks.md)
ANCHOR_QUESTIONS = (
    "What is the capital of Canada?", "What is the capital of Egypt?", "What is the capital of Greece?",
    "What is the capital of Norway?", "What is the capital of Russia?", "What is the capital of Kenya?",
    "What is the capital of Peru?", "What is the capital of China?", "What color is snow?",
    "What color is a ripe tomato?", "What color are most leaves in summer?", "What color is coal?",
    "What is the opposite of wet?", "What is the opposite of big?", "What is the opposite of left?",
    "What is the opposite of open?", "How many wheels does a bicycle have?", "How many hours are in a day?",
    "How many sides does a triangle have?", "How many legs does a cat have?", "How many minutes are in an hour?",
    "How many fingers are on one hand?", "What animal says meow?", "What animal has a trunk?",
    "What animal lives in a hive?", "What bird is a symbol of peace?", "What do cows drink?",
    "What do caterpillars turn into?", "What is the smallest planet in our solar system?",
    "Which planet is called the red planet?", "What is the hottest planet in our solar system?",
    "What is the tallest mountain on Earth?", "What is the longest river in Africa?",
    "Who painted the Mona Lisa?", "Who wrote Pride and Prejudice?", "What language is spoken in Mexico?",
    "What language is spoken in Austria?", "What is the freezing point of water in Fahrenheit?",
    "What gas do humans breathe out?", "In which season is it usually hottest?",
    "What do you call a baby sheep?", "What do you call a baby cow?", "What do you call a young frog?",
    "What is the main ingredient of bread?", "What fruit are raisins made from?",
    "What instrument has black and white keys?", "How many continents are there?",
    "What shape has four equal sides?",
)
SIMPLE_BEFORE, SIMPLE_AFTER = "simple-before.jsonl", "simple-after.jsonl"  # the replies, in the probe's folder
CHAT_TOKENS = 64  # per answer to a general prompt
QUESTION_TOKENS = 32  # per answer to a simple question
ANCHOR_TOKENS = 192  # per anchor answer: only answers the base finished are rehearsed
_SENTENCE_END = re.compile(r"[.!?](?:\s|$)|\n")


def answered_right(reply: str, accepted: tuple[str, ...]) -> bool:
    """Whether the reply's first sentence holds an accepted answer as a whole word."""
    end = _SENTENCE_END.search(reply)
    first = (reply[:end.start()] if end else reply).lower()
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", first) for a in accepted)


def _greedy(model_dir: str | Path, questions: list[str], max_tokens: int) -> list[str]:
    """The model's greedy reply to each question, asked alone in a chat."""
    return [text for text, _ in _greedy_finished(model_dir, questions, max_tokens)]


def _greedy_finished(model_dir: str | Path, questions: list[str], max_tokens: int) -> list[tuple[str, bool]]:
    """(reply, whether the model ended it before max_tokens) per question, greedy, each alone in a chat."""
    from flywheel.inference import LocalEngine, SamplingParams
    from flywheel.models import ChatRenderer
    from flywheel.train.lora import whole_model

    engine = LocalEngine.from_path(str(whole_model(model_dir)))
    renderer = ChatRenderer(engine.tokenizer)
    prompts = [renderer.prompt_ids([{"role": "user", "content": q}]) for q in questions]
    samples = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [(s[0].text, s[0].finish_reason == "stop") for s in samples]


@dataclass(frozen=True)
class Probe:
    """The base's side of the measurement, taken at the start."""

    base: Path
    rows: Path  # the base's answers to GENERAL_PROMPTS as chat rows (JSONL)
    right: tuple[int, ...]  # indices of SIMPLE_QUESTIONS the base answered right

    @classmethod
    def measure(cls, base: str | Path, folder: Path) -> Probe:
        folder.mkdir(parents=True, exist_ok=True)
        replies = _greedy(base, list(GENERAL_PROMPTS), CHAT_TOKENS)
        rows = folder / "general-rows.jsonl"
        rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                         {"role": "assistant", "content": r}]}) + "\n"
                                for p, r in zip(GENERAL_PROMPTS, replies)), encoding="utf-8")
        answers = _greedy(base, [q for q, _ in SIMPLE_QUESTIONS], QUESTION_TOKENS)
        right = tuple(i for i, (a, (_, accepted)) in enumerate(zip(answers, SIMPLE_QUESTIONS))
                      if answered_right(a, accepted))
        _write_replies(folder / SIMPLE_BEFORE, list(SIMPLE_QUESTIONS), answers)
        return cls(Path(base), rows, right)

    def compare(self, model_dir: str | Path) -> dict[str, float]:
        """general_kl (per token, base -> model), simple_right_before (of len(SIMPLE_QUESTIONS)),
        simple_kept (of those, still right) and simple_points_lost (100 x lost / right before)."""
        from flywheel.demo.forgetting import forward_kl

        kl = forward_kl(self.base, model_dir, self.rows)
        asked = [SIMPLE_QUESTIONS[i] for i in self.right]
        answers = _greedy(model_dir, [q for q, _ in asked], QUESTION_TOKENS) if asked else []
        kept = sum(answered_right(a, accepted) for a, (_, accepted) in zip(answers, asked))
        _write_replies(self.rows.parent / SIMPLE_AFTER, asked, answers)
        lost = 100 * (len(asked) - kept) / len(asked) if asked else float("nan")
        return {"general_kl": kl, "simple_right_before": float(len(asked)), "simple_kept": float(kept),
                "simple_points_lost": lost}


def _write_replies(path: Path, asked: list[tuple[str, tuple[str, ...]]], replies: list[str]) -> None:
    """One JSON line per question: {question, reply, right} (what a reader checks the figure by)."""
    path.write_text("".join(json.dumps({"question": q, "reply": r, "right": answered_right(r, accepted)}) + "\n"
                            for (q, accepted), r in zip(asked, replies)), encoding="utf-8")


def self_anchor(base: str | Path, out: Path) -> Path:
    """The base's own greedy answers to ANCHOR_PROMPTS and ANCHOR_QUESTIONS as chat rows (JSONL
    at `out`, in that order), those it finished within ANCHOR_TOKENS only: a row trains the end
    of its answer, and an answer cut by a budget would teach stopping mid-sentence. Rehearsed
    beside the corrections (the loop's `train.anchor_data`), they pull each candidate's everyday
    replies back to the base's (self-distillation), as the tiny base's own SFT data does for it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts = [*ANCHOR_PROMPTS, *ANCHOR_QUESTIONS]
    replies = _greedy_finished(base, prompts, ANCHOR_TOKENS)
    out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                    {"role": "assistant", "content": r}]}) + "\n"
                           for p, (r, finished) in zip(prompts, replies) if finished), encoding="utf-8")
    return out
