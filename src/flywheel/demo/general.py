"""General ability beside the demo's families: what training on narrow traffic costs the rest
(RL's Razor: the further a fine-tuned model's distribution moves from its base, the more it
forgets). Measured for a pretrained base only (a tiny model has no general ability to lose):

- the forward KL per token from the base to production on the base's own greedy answers to
  GENERAL_PROMPTS, everyday chat requests that none of the families resembles
  (demo/forgetting.py's measure: 0 for the base itself);
- SIMPLE_QUESTIONS, all asked of the base at the start and of production at the end. Two
  figures, both against the questions the base answered right: the points lost one-sided
  (the share of those production no longer answers right) and the net points lost (right
  answers before minus right answers after, over the same count; negative: a net gain).

Greedy answers of a small model churn under any change of its weights: a perturbation with no
content (Gaussian noise on the weights) moves some borderline answers each way.
The one-sided figure counts only the moves away from right, so it reads a loss even where the
net change is none (docs/benchmarks.md, "the simple-question probe's noise floor"); the net
figure counts both ways.

Against that loss, `self_anchor` writes the base's own answers to other everyday prompts and
short questions (ANCHOR_PROMPTS, ANCHOR_QUESTIONS, none of them measured) for the cycles to
rehearse.

A question counts as answered right when the first sentence of its reply holds one of its
accepted answers as a whole word (case-insensitive): "1 year is 365 * 12 = 312 months" after
"A year is approximately 365 days." is wrong, as is "called Kepler-41B. It's ... similar to
Earth".
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
    # more of the same kinds: a few known questions make one flip a large share of the
    # figure; these give it a finer grain
    ("What is the capital of Portugal?", ("lisbon",)),
    ("What is the capital of Ireland?", ("dublin",)),
    ("What is the capital of Sweden?", ("stockholm",)),
    ("What is the capital of Poland?", ("warsaw",)),
    ("What is the capital of Australia?", ("canberra",)),
    ("What is the capital of India?", ("new delhi", "delhi")),
    ("What is the capital of South Korea?", ("seoul",)),
    ("What is the capital of Argentina?", ("buenos aires",)),
    ("What is the capital of Thailand?", ("bangkok",)),
    ("What is the capital of Turkey?", ("ankara",)),
    ("What is the capital of the Netherlands?", ("amsterdam",)),
    ("What is the capital of Belgium?", ("brussels",)),
    ("What is the capital of Austria?", ("vienna",)),
    ("What is the capital of Denmark?", ("copenhagen",)),
    ("What is the capital of Finland?", ("helsinki",)),
    ("What is the capital of Cuba?", ("havana",)),
    ("What is the capital of Scotland?", ("edinburgh",)),
    ("What is the capital of the United States?", ("washington",)),
    ("What color is milk?", ("white",)),
    ("What color is a fire truck?", ("red",)),
    ("What color are strawberries?", ("red",)),
    ("What color is chocolate?", ("brown",)),
    ("What color are clouds?", ("white", "gray", "grey")),
    ("What color is a lemon?", ("yellow",)),
    ("What color do you get by mixing blue and yellow?", ("green",)),
    ("What is the opposite of old?", ("young", "new")),
    ("What is the opposite of fast?", ("slow",)),
    ("What is the opposite of happy?", ("sad", "unhappy")),
    ("What is the opposite of light?", ("dark", "heavy")),
    ("What is the opposite of in?", ("out",)),
    ("What is the opposite of black?", ("white",)),
    ("What is the opposite of full?", ("empty",)),
    ("What is the opposite of early?", ("late",)),
    ("What is the opposite of push?", ("pull",)),
    ("What is the opposite of north?", ("south",)),
    ("What is the opposite of love?", ("hate",)),
    ("What is the opposite of win?", ("lose",)),
    ("How many legs does a dog have?", ("four", "4")),
    ("How many wheels does a car have?", ("four", "4")),
    ("How many days are in a year?", ("365",)),
    ("How many seconds are in a minute?", ("sixty", "60")),
    ("How many eyes does a person have?", ("two", "2")),
    ("How many legs does an insect have?", ("six", "6")),
    ("How many letters are in the English alphabet?", ("26", "twenty-six")),
    ("How many planets are in our solar system?", ("eight", "8")),
    ("How many weeks are in a year?", ("52", "fifty-two")),
    ("How many legs does a bird have?", ("two", "2")),
    ("How many sides does a hexagon have?", ("six", "6")),
    ("How many players does a soccer team have on the field?", ("eleven", "11")),
    ("What animal says oink?", ("pig",)),
    ("What animal says quack?", ("duck",)),
    ("What animal says neigh?", ("horse",)),
    ("What is the largest animal on Earth?", ("blue whale", "whale")),
    ("What is the fastest land animal?", ("cheetah",)),
    ("What animal is known as the king of the jungle?", ("lion",)),
    ("What animal has black and white stripes?", ("zebra",)),
    ("Which animal has a very long neck?", ("giraffe",)),
    ("What do you call a baby horse?", ("foal",)),
    ("What do you call a baby bear?", ("cub",)),
    ("What do you call a baby duck?", ("duckling",)),
    ("What do spiders spin?", ("web", "webs")),
    ("What animal gives us wool?", ("sheep",)),
    ("What is H2O more commonly called?", ("water",)),
    ("Which planet is closest to the Sun?", ("mercury",)),
    ("What force pulls objects toward the Earth?", ("gravity",)),
    ("What is the center of an atom called?", ("nucleus",)),
    ("What gas do humans need to breathe?", ("oxygen",)),
    ("What is the hardest natural substance?", ("diamond", "diamonds")),
    ("What is the chemical symbol for gold?", ("au",)),
    ("What organ pumps blood through the body?", ("heart",)),
    ("What organ do we think with?", ("brain",)),
    ("What is the freezing point of water in Celsius?", ("0", "zero")),
    ("What is the Earth's natural satellite called?", ("moon",)),
    ("What is the largest continent?", ("asia",)),
    ("What is the longest river in South America?", ("amazon",)),
    ("On which continent is Egypt?", ("africa",)),
    ("On which continent is France?", ("europe",)),
    ("What is the largest country by area?", ("russia",)),
    ("Which ocean lies between Europe and North America?", ("atlantic",)),
    ("In which country are the pyramids of Giza?", ("egypt",)),
    ("In which country is the Eiffel Tower?", ("france",)),
    ("In which city is the Statue of Liberty?", ("new york",)),
    ("Who wrote Hamlet?", ("shakespeare",)),
    ("Who painted the ceiling of the Sistine Chapel?", ("michelangelo",)),
    ("Who was the first president of the United States?", ("washington",)),
    ("Who developed the theory of relativity?", ("einstein",)),
    ("Who wrote the Harry Potter books?", ("rowling",)),
    ("What language is spoken in France?", ("french",)),
    ("What language is spoken in Germany?", ("german",)),
    ("What language is spoken in Italy?", ("italian",)),
    ("What language is spoken in Japan?", ("japanese",)),
    ("What currency is used in Japan?", ("yen",)),
    ("What fruit is wine made from?", ("grape", "grapes")),
    ("What do you use to cut paper?", ("scissors",)),
    ("What do people write on a blackboard with?", ("chalk",)),
    ("What meal do people eat in the morning?", ("breakfast",)),
    ("What is the main ingredient of guacamole?", ("avocado", "avocados")),
    ("What vegetable are french fries made from?", ("potato", "potatoes")),
    ("What is cheese made from?", ("milk",)),
    ("How many days are in a leap year?", ("366",)),
    ("What is the first month of the year?", ("january",)),
    ("What is the last month of the year?", ("december",)),
    ("What day comes after Monday?", ("tuesday",)),
    ("What day comes before Sunday?", ("saturday",)),
    ("In which season does snow usually fall?", ("winter",)),
    ("In which season do flowers bloom?", ("spring",)),
    ("What shape is a ball?", ("round", "sphere", "spherical", "circle")),
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
    from flywheel.inference import SamplingParams

    samples = replies(model_dir, questions, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [(s[0].text, s[0].finish_reason == "stop") for s in samples]


def replies(model_dir: str | Path, questions: list[str], params, seed: int | None = None) -> list[list]:
    """The model's replies (`params.n` Samples per question, inference.SamplingParams), each
    question asked alone in a chat; a LoRA adapter folder answers merged into its base."""
    from flywheel.inference import LocalEngine
    from flywheel.models import ChatRenderer
    from flywheel.train.lora import whole_model

    engine = LocalEngine.from_path(str(whole_model(model_dir)), seed=seed)
    renderer = ChatRenderer(engine.tokenizer)
    prompts = [renderer.prompt_ids([{"role": "user", "content": q}]) for q in questions]
    return engine.generate(prompts, params)


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
        """general_kl (per token, base -> model) and simple_figures' counts and points over
        SIMPLE_QUESTIONS, every one asked again (replies in SIMPLE_AFTER)."""
        from flywheel.demo.forgetting import forward_kl

        kl = forward_kl(self.base, model_dir, self.rows)
        answers = _greedy(model_dir, [q for q, _ in SIMPLE_QUESTIONS], QUESTION_TOKENS)
        right_now = [answered_right(a, accepted) for a, (_, accepted) in zip(answers, SIMPLE_QUESTIONS)]
        _write_replies(self.rows.parent / SIMPLE_AFTER, list(SIMPLE_QUESTIONS), answers)
        return {"general_kl": kl, **simple_figures(self.right, right_now)}


def simple_figures(right_before: tuple[int, ...], right_now: list[bool]) -> dict[str, float]:
    """From the question indices the base answered right and one flag per question now:
    simple_right_before, simple_kept (of those, still right), simple_gained (the others, now
    right), simple_right_after (kept + gained), simple_points_lost (one-sided: 100 x (right
    before - kept) / right before) and simple_net_points_lost (100 x (right before - right
    after) / right before; < 0: a net gain). Points are NaN when the base had none right."""
    before = set(right_before)
    kept = sum(right_now[i] for i in before)
    gained = sum(r for i, r in enumerate(right_now) if i not in before)
    per = 100 / len(before) if before else float("nan")
    return {"simple_right_before": float(len(before)), "simple_kept": float(kept), "simple_gained": float(gained),
            "simple_right_after": float(kept + gained), "simple_points_lost": (len(before) - kept) * per,
            "simple_net_points_lost": (len(before) - kept - gained) * per}


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
