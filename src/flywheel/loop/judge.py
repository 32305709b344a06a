"""The judge's pure half: which traces a judge model scores, how they are grouped, what the
judge is asked, how its answer is read, and the feedback rows its scores become. judging.py
runs it against a served model.

Traces a verifier can grade never reach the judge: it scores only traces with a response, no
verifier and no verdict from a user (a score or a known label); with `judge.rejudge` off, none
it judged before either. Groups never mix tenants. In ranking mode (RULER-style: a judge ranks
answers more reliably side by side than alone, and a GRPO-style group baseline needs only the
relative order):
  1. attempts whose served prompts normalise equal (curation_rules.prompt_hash) form a group;
     the prompt is shown once and each answer is the response;
  2. the attempts left alone group by their opening (the messages through the first user
     message): the opening is shown once and each answer is what followed it;
  3. an attempt still alone is scored against the rubric alone, or skipped (`singletons`).
A group of more than `max_group` is split evenly in trace order. In rubric and verdict modes
every attempt is its own group.

The judge answers with exactly one JSON object, `{"scores": {"1": 0.8, "2": 0.1},
"explanation": "..."}`: one score in [0, 1] for every answer id and no other id (ids are "1" to
"n"); a single ```json fence around it is allowed, anything else (prose, a missing or extra id,
a score out of range, a duplicate key) is a JudgeAnswerError naming what is wrong.

Verdict mode is for judges too small to write that JSON: each attempt alone, the judge asked a
yes/no question (`VERDICT_QUESTION`), and its score read from the next-token distribution at
the start of its reply, never from text: P(yes) / (P(yes) + P(no)) (`verdict_score`), where a
token counts for "yes" when its text, whitespace stripped and case folded, is a non-empty
prefix of "yes" ("Yes", " yes", "YES", "y"), likewise for "no" ("No", " no", "n"): a
byte-level vocabulary spells the words one letter a token.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Sequence

from flywheel.canonical import canonical
from flywheel.loop.curation_rules import CurationConfig, content_text, opening, prompt_hash, split_conversation, verdict
from flywheel.loop.judge_config import JudgeConfig
from flywheel.traces.results import StoredTrace

GroupKind = Literal["prompt", "opening", "single"]
_FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)\n?\s*```", re.DOTALL)
MAX_EXPLANATION = 500  # characters of the judge's explanation kept in the feedback text
# The judge's requests carry this as their `metadata`: a flywheel server that records its traffic
# keeps it in the trace's metadata.request_metadata, so the judge's own questions are never judged.
JUDGE_METADATA = {"flywheel_judge": "1"}


@dataclass(frozen=True)
class Attempt:
    """One answer the judge may score: a trace's served prompt and the turns that answered it."""

    id: str  # the trace id (the benchmark: an episode's)
    prompt: list[dict] | str  # as served: chat messages, or a raw completion's text
    turns: list[dict]  # what answered it: the response message (an episode: every turn after the prompt)
    tenant: str = "default"
    seq: int = 0
    tools: list[dict] | None = None


@dataclass(frozen=True)
class Group:
    """Answers the judge sees in one call: `context` shown once, then `answers[i]` as answer i+1."""

    id: str  # stable: the kind, tenant and member ids
    kind: GroupKind
    tenant: str
    context: list[dict] | str
    members: tuple[Attempt, ...]
    answers: tuple[tuple[dict, ...], ...]  # per member, the messages after `context`
    tools: list[dict] | None = None

    @property
    def ids(self) -> list[str]:
        return [str(i + 1) for i in range(len(self.members))]


@dataclass(frozen=True)
class JudgeAnswer:
    scores: tuple[float, ...]  # one per member, in member order
    explanation: str = ""


class JudgeAnswerError(ValueError):
    """The judge's reply is not the JSON asked for; the message says what is wrong."""


# ---------------------------------------------------------------- which traces, which groups


def attempt_of(trace: StoredTrace, cfg: CurationConfig) -> Attempt | str:
    """The trace as an Attempt, or why the judge leaves it alone."""
    if (trace.metadata.get("request_metadata") or {}).get("flywheel_judge"):
        return "a judge's own question"
    prompt, response = split_conversation(trace)
    if response is None:
        return "no response"
    if not prompt:
        return "no prompt"
    feedback = trace.feedback
    if any(f.verifier is not None for f in feedback):
        return "a verifier grades it"
    if any(f.source != "judge" and verdict(f, cfg) is not None for f in feedback):
        return "a user's verdict"
    if not cfg.judge.rejudge and any(f.source == "judge" for f in feedback):
        return "judged already"
    return Attempt(trace.id, prompt, [response], trace.tenant, trace.seq, trace.tools)


def group_attempts(attempts: Iterable[Attempt], cfg: JudgeConfig) -> tuple[list[Group], list[Attempt]]:
    """(groups to judge, attempts left alone: singletons when `cfg.singletons == "skip"`)."""
    ordered = sorted(attempts, key=lambda a: (a.seq, a.id))
    if cfg.mode in ("rubric", "verdict"):
        return [_group("single", [a]) for a in ordered], []
    groups: list[Group] = []
    alone: list[Attempt] = []
    for members in _buckets(ordered, lambda a: prompt_hash(a.prompt)):
        if len(members) >= 2:
            groups += [_group("prompt", chunk) for chunk in _even_chunks(members, cfg.max_group)]
        else:
            alone += members
    left: list[Attempt] = []
    for members in _buckets(alone, lambda a: prompt_hash(opening(a.prompt))):
        if len(members) >= 2:
            groups += [_group("opening", chunk) for chunk in _even_chunks(members, cfg.max_group)]
        else:
            left += members
    if cfg.singletons == "rubric":
        groups += [_group("single", [a]) for a in left]
        left = []
    return groups, left


def _buckets(attempts: list[Attempt], key) -> list[list[Attempt]]:
    out: dict[tuple[str, str], list[Attempt]] = {}
    for a in attempts:
        out.setdefault((a.tenant, key(a)), []).append(a)  # a group never mixes tenants
    return list(out.values())


def _even_chunks(members: list[Attempt], most: int) -> list[list[Attempt]]:
    """`members` in ceil(n / most) consecutive chunks whose sizes differ by at most one."""
    k = -(-len(members) // most)
    size, extra = divmod(len(members), k)
    out, start = [], 0
    for i in range(k):
        end = start + size + (i < extra)
        out.append(members[start:end])
        start = end
    return out


def _group(kind: GroupKind, members: list[Attempt]) -> Group:
    first = members[0]
    if kind == "opening":
        context = opening(first.prompt)
        answers = tuple(tuple(_after_opening(m.prompt) + list(m.turns)) for m in members)
    else:
        context = first.prompt
        answers = tuple(tuple(m.turns) for m in members)
    gid = hashlib.sha256(canonical([kind, first.tenant, [m.id for m in members]]).encode()).hexdigest()[:16]
    return Group(gid, kind, first.tenant, context, tuple(members), answers, first.tools)


def _after_opening(prompt: list[dict] | str) -> list[dict]:
    return [] if isinstance(prompt, str) else list(prompt[len(opening(prompt)):])


# ---------------------------------------------------------------- the question


def render_messages(messages: Sequence[dict] | str) -> str:
    """Messages as the judge reads them: `[role] text` per message, `[assistant calls NAME]
    ARGUMENTS` per tool call; a raw completion's text as it is."""
    if isinstance(messages, str):
        return messages
    lines = []
    for m in messages:
        role = m.get("role", "?")
        text = content_text(m.get("content")) if m.get("content") is not None else (m.get("refusal") or "")
        if text.strip():
            lines.append(f"[{role}] {text.strip()}")
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            lines.append(f"[{role} calls {fn.get('name')}] {args if isinstance(args, str) else canonical(args)}")
        if not text.strip() and not m.get("tool_calls"):
            lines.append(f"[{role}] (empty)")
    return "\n".join(lines)


def clip(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters, keeping its head and tail (a final answer is often last)."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}\n...[{len(text) - head - tail} characters cut]...\n{text[-tail:]}"


def _format(ids: list[str]) -> str:
    example = ", ".join(f'"{i}": <score>' for i in ids)
    return f'{{"scores": {{{example}}}, "explanation": "<one short sentence>"}}'


def judge_messages(group: Group, cfg: JudgeConfig) -> list[dict]:
    """The chat messages that ask the judge to score `group` (system: the rubric and the
    answer format; user: the task once, then each numbered answer)."""
    ids = group.ids
    if len(ids) == 1:
        how = ("You are shown one task and one answer to it. Score the answer on its own against the rubric, "
               "from 0 (fails the task) to 1 (fully achieves it).")
    else:
        how = (f"You are shown one task and {len(ids)} answers to it, numbered 1 to {len(ids)}. Compare them and "
               "score each from 0 (fails the task) to 1 (fully achieves it): a better answer gets a higher score, "
               "equally good answers the same score.")
    system = (f"You judge the answers of an AI assistant.\nRubric: {cfg.rubric}\n{how}\n"
              f"Reply with only this JSON object and nothing else: {_format(ids)}")
    parts = [f"# Task\n{clip(render_messages(group.context), cfg.max_chars)}"]
    if group.tools:
        names = ", ".join(str((t.get("function") or {}).get("name")) for t in group.tools)
        parts.append(f"Tools the assistant could call: {names}")
    for i, answer in zip(ids, group.answers):
        parts.append(f"# Answer {i}\n{clip(render_messages(list(answer)), cfg.max_chars)}")
    parts.append(f"Scores for answer{'s 1 to ' + ids[-1] if len(ids) > 1 else ' 1'}, as the JSON object:")
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def retry_messages(messages: list[dict], reply: str, error: str, n: int) -> list[dict]:
    """The question again after a malformed reply: the reply, then what was wrong with it."""
    ids = [str(i + 1) for i in range(n)]
    return [*messages, {"role": "assistant", "content": clip(reply, 2000)},
            {"role": "user", "content": f"That reply could not be read: {error}. Reply again with only the JSON "
                                        f"object {_format(ids)}, one score from 0 to 1 for each answer."}]


VERDICT_QUESTION = "Does the answer correctly and fully solve the task? Answer yes or no."


def verdict_messages(group: Group, cfg: JudgeConfig) -> list[dict]:
    """The chat messages that ask the judge verdict mode's yes/no question about the single
    answer of `group` (system: the rubric; user: the task, the answer, then VERDICT_QUESTION)."""
    if len(group.members) != 1:
        raise ValueError(f"verdict mode judges one answer at a time, the group has {len(group.members)}")
    system = (f"You judge the answers of an AI assistant.\nRubric: {cfg.rubric}\n"
              "You are shown one task and one answer to it. Reply with yes or no.")
    parts = [f"# Task\n{clip(render_messages(group.context), cfg.max_chars)}"]
    if group.tools:
        names = ", ".join(str((t.get("function") or {}).get("name")) for t in group.tools)
        parts.append(f"Tools the assistant could call: {names}")
    parts.append(f"# Answer\n{clip(render_messages(list(group.answers[0])), cfg.max_chars)}")
    parts.append(VERDICT_QUESTION)
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


# ---------------------------------------------------------------- the answer


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise JudgeAnswerError(f"key {k!r} appears twice")
        seen[k] = v
    return seen


def parse_answer(text: str, n: int) -> JudgeAnswer:
    """The scores of answers 1..n in `text`, read strictly (see the module's docstring)."""
    body = text.strip()
    fenced = _FENCE.fullmatch(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        data = json.loads(body, object_pairs_hook=_no_duplicates)
    except JudgeAnswerError:
        raise
    except ValueError as e:
        raise JudgeAnswerError(f"not a JSON object ({e}): {clip(text, 120)!r}") from None
    if not isinstance(data, dict):
        raise JudgeAnswerError(f"expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {"scores", "explanation"})
    if unknown:
        raise JudgeAnswerError(f"unknown key(s) {', '.join(map(repr, unknown))}; only 'scores' and 'explanation'")
    scores = data.get("scores")
    if not isinstance(scores, dict):
        raise JudgeAnswerError("'scores' must be an object of answer id -> score")
    ids = [str(i + 1) for i in range(n)]
    missing, extra = [i for i in ids if i not in scores], sorted(k for k in scores if k not in ids)
    if missing or extra:
        raise JudgeAnswerError("scores " + "; ".join(
            x for x in (f"missing for answer(s) {', '.join(missing)}" if missing else "",
                        f"for unknown answer id(s) {', '.join(map(repr, extra))}" if extra else "") if x)
            + f" (the ids are 1 to {n})")
    out = []
    for i in ids:
        v = scores[i]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise JudgeAnswerError(f"scores.{i}: expected a number from 0 to 1, got {v!r}")
        if not 0 <= v <= 1:
            raise JudgeAnswerError(f"scores.{i}: {v!r} is outside [0, 1]")
        out.append(float(v))
    explanation = data.get("explanation", "")
    if not isinstance(explanation, str):
        raise JudgeAnswerError(f"'explanation' must be a string, got {type(explanation).__name__}")
    return JudgeAnswer(tuple(out), explanation.strip()[:MAX_EXPLANATION])


# ---------------------------------------------------------------- the feedback


def judge_tag(model: str, cfg: JudgeConfig) -> str:
    """What makes two judgements of one group the same judgement: the model, mode and rubric."""
    return hashlib.sha256(canonical([model, cfg.mode, cfg.rubric]).encode()).hexdigest()[:8]


def feedback_bodies(group: Group, answer: JudgeAnswer, model: str, cfg: JudgeConfig) -> list[tuple[str, dict]]:
    """(trace id, FeedbackIn body) per member: the score with `source: "judge"`, and in `text`
    a JSON object {"judge": model, "mode", "group": id, "kind", "size", "explanation"}. The
    idempotency key (judge tag, group, trace) makes a rerun of the same judgement a no-op."""
    text = canonical({"judge": model, "mode": cfg.mode, "group": group.id, "kind": group.kind,
                      "size": len(group.members), "explanation": answer.explanation})
    tag = judge_tag(model, cfg)
    return [(m.id, {"score": s, "source": "judge", "text": text, "idempotency_key": f"judge:{tag}:{group.id}:{m.id}"})
            for m, s in zip(group.members, answer.scores)]


# ---------------------------------------------------------------- verdict mode's score


def verdict_side(token: str) -> Literal["yes", "no"] | None:
    """Which word a reply's first token starts: its text, whitespace stripped and case folded,
    a non-empty prefix of "yes" or of "no" (" Yes", "yes", "Y"; "No", " no", "n"), else None."""
    t = token.strip().casefold()
    if not t:
        return None
    if "yes".startswith(t):
        return "yes"
    if "no".startswith(t):
        return "no"
    return None


@dataclass(frozen=True)
class VerdictScore:
    score: float  # P(yes) / (P(yes) + P(no))
    p_yes: float
    p_no: float

    def answer(self) -> JudgeAnswer:
        """As a one-member JudgeAnswer; the explanation keeps both probabilities (their sum
        says how much of the judge's next token was a yes or a no at all)."""
        return JudgeAnswer((self.score,), f"P(yes)={self.p_yes:.4f} P(no)={self.p_no:.4f}")


def verdict_score(candidates: Iterable[tuple[str, float]]) -> VerdictScore | None:
    """Verdict mode's score from (token text, logprob) pairs of the judge's next-token
    distribution (all of it, or the top k an API returns; each token once): the yes tokens'
    probabilities summed, over the yes and no tokens' summed. None when neither appears (or
    both underflow to 0)."""
    p = {"yes": 0.0, "no": 0.0}
    for token, logprob in candidates:
        side = verdict_side(token)
        if side is not None and logprob is not None and math.isfinite(logprob):
            p[side] += math.exp(logprob)
    total = p["yes"] + p["no"]
    if not total > 0:
        return None
    return VerdictScore(p["yes"] / total, p["yes"], p["no"])
