"""The rules of curation: what a trace's outcome is, when two prompts are the same, when a
prompt is contaminated by an eval set, and which side of the held-out split a prompt is on.
All pure functions of their arguments (and `CurationConfig`); each states its rule.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Iterable, Literal

import orjson
from pydantic import Field, model_validator

from flywheel.canonical import canonical
from flywheel.config import Config
from flywheel.loop.judge_config import JudgeConfig
from flywheel.traces.results import StoredFeedback, StoredTrace

Verdict = Literal["pass", "fail", "neutral"]
Outcome = Literal["pass", "fail", "neutral", "unknown"]
_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"\w+")


class CurationConfig(Config):
    fail_below: float = Field(0.5, description="a score below this is a failure")
    pass_at: float = Field(1.0, description="a score at or above this is a pass (a good response)")
    failure_labels: list[str] = Field(default_factory=lambda: ["bad", "wrong", "fail", "failure", "thumbs_down"],
                                      description="labels that mean failure (case-insensitive)")
    success_labels: list[str] = Field(default_factory=lambda: ["good", "correct", "pass", "thumbs_up"],
                                      description="labels that mean a good response (case-insensitive)")
    heldout_fraction: float = Field(0.25, ge=0, le=1, description="share of each source's prompts held out")
    min_heldout: int = Field(1, ge=0, description="held-out prompts per source with >= 2 prompts")
    ngram: int = Field(13, ge=1, description="word n-gram length for decontamination")
    max_pairs_per_prompt: int = Field(4, ge=1, description="DPO pairs per prompt (one per distinct bad response)")
    seed: str = Field("flywheel", description="salt of the held-out split; change it to draw a new split")
    environments: list[str] = Field(default_factory=list, description=(
        "environments a verifier may name besides the built-ins ('package.module:load' or 'file.py:load'): "
        "a verifier arrives with feedback from clients, and replaying it imports and runs its loader"))
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description=(
        "the judge of traces without a verifier (`flywheel traces judge`) and the thresholds of its scores"))

    @model_validator(mode="after")
    def _consistent(self) -> CurationConfig:
        if self.fail_below > self.pass_at:
            raise ValueError(f"fail_below ({self.fail_below}) must not exceed pass_at ({self.pass_at})")
        both = {x.strip().lower() for x in self.failure_labels} & {x.strip().lower() for x in self.success_labels}
        if both:
            raise ValueError(f"labels both failure and success: {sorted(both)}")
        return self


# ---------------------------------------------------------------- outcome


def verdict(fb: StoredFeedback, cfg: CurationConfig) -> Verdict | None:
    """From the score when there is one: "fail" below fail_below, "pass" at or above pass_at,
    "neutral" in between (a judge's score, `source == "judge"`, against cfg.judge's two
    thresholds, a user's against cfg's own); else from the label (stripped, case-insensitive) in
    failure_labels or success_labels; else None (text only, a correction, a verifier or an
    unknown label judges nothing)."""
    if fb.score is not None:
        cut = cfg.judge if fb.source == "judge" else cfg
        return "fail" if fb.score < cut.fail_below else "pass" if fb.score >= cut.pass_at else "neutral"
    if fb.label is not None:
        label = fb.label.strip().lower()
        if label in {x.strip().lower() for x in cfg.failure_labels}:
            return "fail"
        if label in {x.strip().lower() for x in cfg.success_labels}:
            return "pass"
    return None


def _newest_first(feedback: list[StoredFeedback]) -> list[StoredFeedback]:
    order = sorted(range(len(feedback)), key=lambda i: (feedback[i].created_at, i), reverse=True)
    return [feedback[i] for i in order]


def outcome(trace: StoredTrace, cfg: CurationConfig) -> Outcome:
    """The verdict of the trace's latest feedback that has one (latest by created_at; equal
    times: the later stored), or "unknown"."""
    for fb in _newest_first(trace.feedback):
        v = verdict(fb, cfg)
        if v is not None:
            return v
    return "unknown"


def latest(trace: StoredTrace, field: str) -> Any:
    """The newest non-null `field` ("correction", "verifier") among the trace's feedback."""
    for fb in _newest_first(trace.feedback):
        if getattr(fb, field) is not None:
            return getattr(fb, field)
    return None


# ---------------------------------------------------------------- normalisation


def opening(messages: list[dict] | str) -> list[dict] | str:
    """The messages through the first user message: what every turn of one episode (and every
    retry of one question) shares, so the train / held-out split keeps them on one side. A
    raw-completion prompt (a string) is its own opening."""
    if isinstance(messages, str):
        return messages
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return messages[:i + 1]
    return messages


def posed(prompt: list[dict] | str) -> list[dict] | str:
    """The task a served prompt poses: its messages through the last user message, as served.
    What follows that message (the agent's own tool calls and their results) is the episode
    the replaying environment plays again; a prompt with no user message, or a raw
    completion's text, is posed whole."""
    if isinstance(prompt, str):
        return prompt
    last = max((i for i, m in enumerate(prompt) if m.get("role") == "user"), default=len(prompt) - 1)
    return prompt[:last + 1]


def split_conversation(trace: StoredTrace) -> tuple[list[dict] | str, dict | None]:
    """(prompt, response message or None): the prompt as served, messages of a chat trace or
    the text of a raw completion (`trace.prompt`). The response is `trace.response` when set;
    else, when a chat trace's `messages` ends with an assistant message (an imported episode),
    that last message, and the prompt is the messages before it; else there is none."""
    if trace.prompt is not None:
        return trace.prompt, trace.response
    messages = list(trace.messages)
    if trace.response is not None:
        return messages, trace.response
    if messages and messages[-1].get("role") == "assistant":
        return messages[:-1], messages[-1]
    return messages, None


def normalize_text(text: str) -> str:
    return _SPACE.sub(" ", text).strip().lower()


def content_text(content: Any) -> str:
    """A message content as one string: text parts joined, other parts as canonical JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       else canonical(p) for p in content)
    return canonical(content)


def _arguments(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return orjson.loads(args)
        except orjson.JSONDecodeError:
            return args
    return args


def normalize_message(m: dict) -> list:
    """[role, text, tool calls]: "developer" read as "system"; the content as one string (the
    refusal when there is no content), lowercased, whitespace runs collapsed and stripped; tool
    calls as [name, arguments], JSON-string arguments parsed as orjson reads them (ids dropped:
    they are random)."""
    role = "system" if m.get("role") == "developer" else m.get("role")
    text = content_text(m.get("content")) if m.get("content") is not None else (m.get("refusal") or "")
    calls = [[(c.get("function") or {}).get("name"), _arguments((c.get("function") or {}).get("arguments"))]
             for c in m.get("tool_calls") or []]
    return [role, normalize_text(text), calls]


def as_messages(prompt: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def prompt_hash(messages: str | list[dict]) -> str:
    """SHA-256 (hex) of the normalised prompt's canonical JSON (`flywheel.canonical`, the text
    the trace store hashes too): equal for prompts that differ only in case, whitespace,
    tool-call ids or the spelling of tool-call arguments (string vs object). A plain string
    prompt (raw-completion tasks, eval strings) is one user message."""
    return hashlib.sha256(canonical([normalize_message(m) for m in as_messages(messages)]).encode()).hexdigest()


def response_hash(message: dict) -> str:
    """SHA-256 of one normalised assistant message (tells distinct responses apart)."""
    return hashlib.sha256(canonical(normalize_message(message)).encode()).hexdigest()


def user_words(prompt: str | list[dict]) -> list[str]:
    """The words (\\w+ runs, lowercased) of the prompt's user messages, in order, joined across messages."""
    text = " ".join(content_text(m.get("content")) for m in as_messages(prompt) if m.get("role") == "user")
    return _WORD.findall(text.lower())


# ---------------------------------------------------------------- training messages


class Unusable(ValueError):
    """A trace that cannot become a training row; the message says why."""


def training_message(m: dict, where: str) -> dict:
    """One message as the SFT / DPO loaders take it: roles system/user/assistant/tool
    ("developer" becomes "system"), text content as a string, tool_calls and tool_call_id
    kept, everything else (refusal, reasoning_content) dropped. Non-text parts are refused."""
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise Unusable(f"{where}: role {role!r} has no place in a training row")
    out: dict[str, Any] = {"role": role}
    content = m.get("content")
    if isinstance(content, list):
        other = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content
                 if not (isinstance(p, dict) and p.get("type") == "text")]
        if other:
            raise Unusable(f"{where}: content part of type {other[0]!r} (training rows hold text only)")
        content = content_text(content)
    if content is None and role == "assistant" and not m.get("tool_calls"):
        content = m.get("refusal")
    if content is not None:
        out["content"] = content
    elif role != "assistant":
        raise Unusable(f"{where}: a {role} message without content")
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = m["tool_calls"]
    if role == "assistant" and not out.get("content") and not out.get("tool_calls"):
        raise Unusable(f"{where}: an assistant message with neither content nor tool_calls")
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def training_reply(m: dict, where: str) -> dict:
    """A correction or response as a training message: it must be an assistant message."""
    if not isinstance(m, dict) or m.get("role") != "assistant":
        role = m.get("role") if isinstance(m, dict) else type(m).__name__
        raise Unusable(f"{where}: must be an assistant message, not {role!r}")
    return training_message(m, where)


def training_messages(messages: list[dict], where: str = "messages") -> list[dict]:
    if not messages:
        raise Unusable("no prompt before the response")
    return [training_message(m, f"{where}[{i}]") for i, m in enumerate(messages)]


def with_tools(row: dict, tools: list | None) -> dict:
    """`row` with the `tools` the trace offered, when it offered any."""
    return {**row, "tools": tools} if tools else row


def training_row(prompt: list[dict] | str, reply: dict, where: str, tools: list | None) -> dict:
    """An SFT row of `prompt` answered by `reply` (an assistant message), in the prompt's own
    format: chat `{"messages", "tools"?}`, or `{"prompt", "completion"}` for a raw completion
    (the reply's text: a raw completion has no tool calls)."""
    if not isinstance(prompt, str):
        return with_tools({"messages": training_messages(prompt) + [training_reply(reply, where)]}, tools)
    message = training_reply(reply, where)
    if message.get("tool_calls") or not isinstance(message.get("content"), str):
        raise Unusable(f"{where}: a raw completion's {where} must be text, without tool calls")
    return {"prompt": prompt, "completion": message["content"]}


# ---------------------------------------------------------------- decontamination


class EvalIndex:
    """Eval prompts, for decontamination: their prompt hashes and their word n-grams.

    An eval prompt with at least n words contributes its n-grams; a shorter one its whole
    word sequence. A training prompt is contaminated when its hash equals an eval prompt's
    ("exact"), or when its user words contain any indexed gram as a contiguous run ("ngram";
    so a short eval question quoted inside a longer prompt counts, a short prompt that is a
    piece of a long eval question does not). Eval prompts: strings, message lists, or
    anything with a `.prompt` (a Task).
    """

    def __init__(self, eval_prompts: Iterable[Any], n: int):
        self.n = n
        self.hashes: dict[str, int] = {}  # hash -> index of the first eval prompt with it
        self.grams: dict[tuple[str, ...], int] = {}  # gram -> index of the first eval prompt with it
        for i, p in enumerate(eval_prompts):
            p = getattr(p, "prompt", p)
            if not isinstance(p, (str, list)):
                raise TypeError(f"eval prompt {i}: expected a string or a message list, got {type(p).__name__}")
            self.hashes.setdefault(prompt_hash(p), i)
            words = user_words(p)
            for gram in ngrams(words, n) if len(words) >= n else ([tuple(words)] if words else []):
                self.grams.setdefault(gram, i)
        self.lengths = sorted({len(g) for g in self.grams})

    def __len__(self) -> int:
        return len(self.hashes)

    def check(self, hashes: Iterable[str], prompts: Iterable[str | list[dict]]) -> str | None:
        """Why an item (its prompt hashes, its prompts) is contaminated, or None."""
        for h in hashes:
            if h in self.hashes:
                return f"exact: same prompt as eval prompt {self.hashes[h]}"
        for p in prompts:
            words = user_words(p)
            for k in self.lengths:
                for gram in ngrams(words, k):
                    if gram in self.grams:
                        return f"ngram: shares {' '.join(gram)!r} with eval prompt {self.grams[gram]}"
        return None


def ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


# ---------------------------------------------------------------- held-out split


def heldout_score(seed: str, prompt_hash_: str) -> float:
    """A uniform number in [0, 1) fixed by (seed, prompt hash): the prompt is held out when it
    is below heldout_fraction, so it lands on the same side in every cycle and rerun."""
    return int(hashlib.sha256(f"{seed}\0{prompt_hash_}".encode()).hexdigest()[:16], 16) / 2 ** 64


def choose_heldout(prompts_by_source: dict[str, Iterable[str]], cfg: CurationConfig) -> set[str]:
    """The held-out prompt hashes. Per source: those scoring below heldout_fraction; when that
    is fewer than min_heldout and the source has >= 2 prompts, the lowest-scoring ones up to
    min(min_heldout, prompts - 1), so the top-up never takes a source's last training prompt.
    The top-up depends on the source's other prompts: a topped-up prompt can return to train
    in a later cycle once the source has prompts below the fraction."""
    held: set[str] = set()
    for source in sorted(prompts_by_source):
        scored = sorted((heldout_score(cfg.seed, h), h) for h in set(prompts_by_source[source]))
        chosen = [h for u, h in scored if u < cfg.heldout_fraction]
        want = min(cfg.min_heldout, len(scored) - 1)
        if len(scored) >= 2 and len(chosen) < want:
            chosen = [h for _, h in scored[:want]]
        held.update(chosen)
    return held
