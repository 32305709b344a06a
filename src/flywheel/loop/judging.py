"""Run the judge: groups of traces (loop/judge.py) through a judge model, scores into feedback.

The judge is a chat model behind a `JudgeClient`: `HTTPJudge` calls any OpenAI-compatible
chat API (a `flywheel serve` process, greedy, `max_tokens` from the config); `SamplerJudge`
runs a Sampler in this process (a LocalEngine: tests and benchmarks), all its questions in one
`generate` call. Every group is asked once; a group whose reply is malformed is asked again
once, shown its reply and what was wrong; a second malformed reply, or a failed request, skips
the group and counts the reason. A skipped group writes nothing: no score is ever made up.

Verdict mode (judge.py) reads no text: a client's `next_tokens` gives the judge's next-token
(token, logprob) pairs at the start of its reply to the yes/no question. `SamplerJudge` runs
one forward pass of its model over the rendered chat prompt (the whole vocabulary; a sampler
without a torch model in this process: one greedy token with its top 20 alternatives);
`HTTPJudge` asks the chat API for one token with `logprobs: true, top_logprobs: 20` (flywheel
serve supports them; a server that returns none fails the question with that reason). A reply
with neither a yes nor a no token among those skips the group; nothing is retried.

`run_judge(store, client, cfg)` reads the store's traces (one tenant's, or all, each group
within one tenant), judges the eligible ones and writes each score as feedback with
`source="judge"` on the trace's own tenant (judge.feedback_bodies). Curation then reads those
scores with `curation.judge`'s thresholds: a judged-bad and a judged-good answer to one prompt
become a DPO pair, a judged-good one a replay row. A judged trace has no verifier, so like a
user-scored trace without one it makes no RL task and never enters the gate's suites.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext as _nothing
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Protocol, Sequence

from flywheel.loop.curation_rules import CurationConfig, verdict
from flywheel.loop.judge import (
    JUDGE_METADATA,
    Group,
    JudgeAnswer,
    JudgeAnswerError,
    attempt_of,
    verdict_messages,
    verdict_score,
    verdict_side,
    feedback_bodies,
    group_attempts,
    judge_messages,
    parse_answer,
    retry_messages,
)
from flywheel.loop.judge_config import JudgeConfig
from flywheel.traces.results import IdempotencyConflict, StoredFeedback

MAX_LISTED = 100  # skipped groups listed in a report (all are counted)
VERDICT_TOP_LOGPROBS = 20  # alternatives asked for over HTTP (OpenAI's most)


class JudgeRequestError(RuntimeError):
    """A question the judge model did not answer (connection, HTTP status, a refused prompt)."""


class JudgeClient(Protocol):
    model: str  # the judge model's name, recorded with every score

    def chat(self, conversations: Sequence[list[dict]], max_tokens: int) -> list[str | JudgeRequestError]:
        """One reply text per conversation, greedy; a question that failed is its JudgeRequestError."""
        ...

    def next_tokens(self, conversations: Sequence[list[dict]]) -> list[list[tuple[str, float]] | JudgeRequestError]:
        """Verdict mode: per conversation, (token text, logprob) pairs of the judge's distribution
        over the first token of its reply (all of it, or its most likely tokens)."""
        ...


class HTTPJudge:
    """A model behind an OpenAI-compatible chat API: POST {base_url}/chat/completions.
    base_url: e.g. http://127.0.0.1:8000/v1 (a `flywheel serve`); `concurrency` questions in
    flight at once (a flywheel server batches them)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, *, timeout_s: float = 120.0,
                 concurrency: int = 4):
        try:
            import httpx
        except ImportError:  # pragma: no cover - httpx comes with the dev and serve installs
            raise ImportError("the HTTP judge needs httpx: pip install 'flywheel[dev]' (or httpx)") from None
        self.model, self.concurrency = model, max(1, concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self._errors = (httpx.HTTPError,)

    def close(self) -> None:
        self._http.close()

    def _post(self, body: dict) -> dict | JudgeRequestError:
        """The chat completion the judge server answered, or why there is none."""
        try:
            r = self._http.post("/chat/completions", json={**body, "metadata": JUDGE_METADATA})
        except self._errors as e:  # JUDGE_METADATA: a flywheel server that records traces marks them: never judged
            return JudgeRequestError(f"{type(e).__name__}: {e}")
        if r.status_code != 200:
            return JudgeRequestError(f"HTTP {r.status_code}: {r.text[:300]}")
        try:
            choice = r.json()["choices"][0]
            if not isinstance(choice, dict):
                raise TypeError("a choice is not an object")
            return choice
        except (ValueError, KeyError, IndexError, TypeError) as e:
            return JudgeRequestError(f"not a chat completion ({type(e).__name__}): {r.text[:300]}")

    def _ask(self, messages: list[dict], max_tokens: int) -> str | JudgeRequestError:
        choice = self._post({"model": self.model, "messages": messages, "temperature": 0, "max_tokens": max_tokens})
        if isinstance(choice, JudgeRequestError):
            return choice
        try:
            return choice["message"]["content"] or ""
        except (KeyError, TypeError) as e:
            return JudgeRequestError(f"not a chat completion ({type(e).__name__}): {str(choice)[:300]}")

    def chat(self, conversations: Sequence[list[dict]], max_tokens: int) -> list[str | JudgeRequestError]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda m: self._ask(m, max_tokens), conversations))

    def _first_token(self, messages: list[dict]) -> list[tuple[str, float]] | JudgeRequestError:
        choice = self._post({"model": self.model, "messages": messages, "temperature": 0, "max_tokens": 1,
                             "logprobs": True, "top_logprobs": VERDICT_TOP_LOGPROBS})
        if isinstance(choice, JudgeRequestError):
            return choice
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if content is None:
            return JudgeRequestError("the judge server returned no logprobs: verdict mode needs a chat API that "
                                     f"supports `logprobs: true, top_logprobs: {VERDICT_TOP_LOGPROBS}`")
        if not content:  # a reply of only its end token has no token entry, so no alternatives
            return JudgeRequestError("the judge's reply was empty (it ended at once): no first token to read")
        top = content[0].get("top_logprobs") or []
        if not top:
            return JudgeRequestError("the judge server returned no top_logprobs: verdict mode needs "
                                     f"`top_logprobs: {VERDICT_TOP_LOGPROBS}` on chat completions")
        try:
            return [(str(t["token"]), float(t["logprob"])) for t in top]
        except (KeyError, TypeError, ValueError) as e:
            return JudgeRequestError(f"unreadable top_logprobs ({type(e).__name__}): {str(top)[:300]}")

    def next_tokens(self, conversations: Sequence[list[dict]]) -> list[list[tuple[str, float]] | JudgeRequestError]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._first_token, conversations))


class SamplerJudge:
    """A Sampler in this process as the judge (inference/sampler.py: a LocalEngine, vLLM),
    its questions rendered by the model's chat template and sampled greedily in one call."""

    def __init__(self, sampler: Any, tokenizer: Any, model: str):
        from flywheel.models import ChatRenderer

        self.sampler, self.tokenizer, self.model = sampler, tokenizer, model
        self.renderer = ChatRenderer(tokenizer)

    def chat(self, conversations: Sequence[list[dict]], max_tokens: int) -> list[str | JudgeRequestError]:
        from flywheel.inference import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        prompts = [self.renderer.prompt_ids(m) for m in conversations]
        try:
            return [self._text(s[0]) for s in self.sampler.generate(prompts, params)]
        except ValueError:  # one prompt the sampler refuses (too long) refuses the batch: ask one by one
            out: list[str | JudgeRequestError] = []
            for p in prompts:
                try:
                    out.append(self._text(self.sampler.generate([p], params)[0][0]))
                except ValueError as e:
                    out.append(JudgeRequestError(str(e)))
            return out

    def _text(self, sample) -> str:
        return sample.text if sample.text is not None else self.tokenizer.decode(sample.token_ids,
                                                                                 skip_special_tokens=True)

    def _yes_no_ids(self) -> tuple[list[int], list[str]]:
        """The ids (and texts) of the vocabulary's tokens that start a yes or a no (judge.verdict_side),
        named as an OpenAI API names them (models/token_bytes.py); computed once."""
        if getattr(self, "_yes_no", None) is None:
            from flywheel.models.token_bytes import token_table, token_text

            table = token_table(self.tokenizer)
            ids = [i for i, raw in enumerate(table.raw)
                   if raw is not None and i not in table.special and verdict_side(token_text(raw)) is not None]
            self._yes_no = (ids, [token_text(table.raw[i]) for i in ids])
        return self._yes_no

    def next_tokens(self, conversations: Sequence[list[dict]]) -> list[list[tuple[str, float]] | JudgeRequestError]:
        """One forward pass of the model per question over its rendered prompt (chat template with
        the generation prompt): the yes and no tokens' logprobs under the whole next-token
        distribution (temperature 1). A sampler with no torch model here: one greedy token and its
        VERDICT_TOP_LOGPROBS alternatives."""
        model = getattr(self.sampler, "model", None)
        if model is None or not hasattr(model, "forward"):
            return self._next_tokens_sampled(conversations)
        import torch

        ids, texts = self._yes_no_ids()
        most = getattr(self.sampler, "max_positions", None) or 1 << 30
        device = next(model.parameters()).device
        lock = getattr(self.sampler, "lock", None)
        out: list[list[tuple[str, float]] | JudgeRequestError] = []
        for messages in conversations:
            prompt = self.renderer.prompt_ids(messages)
            if len(prompt) > most:
                out.append(JudgeRequestError(f"the question has {len(prompt)} tokens; the judge's context is {most}"))
                continue
            with (lock if lock is not None else _nothing()), torch.inference_mode():
                logits_V = model(input_ids=torch.tensor([prompt], device=device)).logits[0, -1].float()
            logprobs_V = torch.log_softmax(logits_V, dim=-1)
            out.append(list(zip(texts, logprobs_V[ids].tolist())))
        return out

    def _next_tokens_sampled(self, conversations):
        from flywheel.inference import SamplingParams
        from flywheel.models.token_bytes import token_table, token_text

        params = SamplingParams(temperature=0.0, max_tokens=1, top_logprobs=VERDICT_TOP_LOGPROBS)
        table = token_table(self.tokenizer)
        out: list[list[tuple[str, float]] | JudgeRequestError] = []
        for messages in conversations:
            try:
                sample = self.sampler.generate([self.renderer.prompt_ids(messages)], params)[0][0]
            except ValueError as e:
                out.append(JudgeRequestError(str(e)))
                continue
            top = (sample.top_logprobs or [[]])[0]
            out.append([(token_text(table.raw[i]), lp) for i, lp in top if table.bytes_of(i) is not None])
        return out


@dataclass
class GroupResult:
    group: Group
    answer: JudgeAnswer | None  # None: skipped, `reason` says why
    reason: str | None = None
    asked: int = 0  # questions sent for this group (2 after a retry)


def judge_groups(client: JudgeClient, groups: Sequence[Group], cfg: JudgeConfig) -> list[GroupResult]:
    """Every group asked once, the malformed ones once more; in `groups`' order."""
    if cfg.mode == "verdict":
        return _verdict_groups(client, groups, cfg)
    questions = [judge_messages(g, cfg) for g in groups]
    results = [GroupResult(g, None) for g in groups]
    retry: list[tuple[int, list[dict]]] = []
    for i, reply in enumerate(client.chat(questions, cfg.max_tokens)):
        error = _take_reply(results[i], reply, asked=1)
        if error is not None:
            retry.append((i, retry_messages(questions[i], reply, str(error), len(groups[i].members))))
    replies = client.chat([m for _, m in retry], cfg.max_tokens) if retry else []
    for (i, _), reply in zip(retry, replies):
        error = _take_reply(results[i], reply, asked=2)
        if error is not None:
            results[i].reason = f"malformed twice: {error}"
    return results


def _verdict_groups(client: JudgeClient, groups: Sequence[Group], cfg: JudgeConfig) -> list[GroupResult]:
    """Verdict mode: each one-answer group's score from the judge's first-token distribution."""
    if not callable(getattr(client, "next_tokens", None)):
        raise TypeError(f"the judge client {type(client).__name__} has no next_tokens: it cannot judge in verdict mode")
    results = [GroupResult(g, None, asked=1) for g in groups]
    replies = client.next_tokens([verdict_messages(g, cfg) for g in groups]) if groups else []
    for result, reply in zip(results, replies):
        if isinstance(reply, JudgeRequestError):
            result.reason = f"request failed: {reply}"
            continue
        got = verdict_score(reply)
        if got is None:
            result.reason = "no verdict: neither a yes nor a no token among the judge's next tokens"
        else:
            result.answer = got.answer()
    return results


def _take_reply(result: GroupResult, reply: str | JudgeRequestError, asked: int) -> JudgeAnswerError | None:
    """Record the judge's `asked`-th reply on `result`: its answer, or the failed request as the
    reason; a malformed answer is returned for the caller to retry or give up on."""
    result.asked = asked
    if isinstance(reply, JudgeRequestError):
        result.reason = f"request failed: {reply}"
        return None
    try:
        result.answer = parse_answer(reply, len(result.group.members))
    except JudgeAnswerError as e:
        return e
    return None


@dataclass
class JudgeReport:
    judge: str
    mode: str
    traces: int = 0  # read from the store
    left_alone: dict[str, int] = field(default_factory=dict)  # why a trace was not judged -> count
    groups: int = 0
    groups_by_kind: dict[str, int] = field(default_factory=dict)
    judged_groups: int = 0
    retried_groups: int = 0  # asked twice (their first reply was malformed)
    scores_written: int = 0  # feedback rows stored (a rerun of the same judgement stores none anew)
    verdicts: dict[str, int] = field(default_factory=lambda: {"pass": 0, "fail": 0, "neutral": 0})
    skipped: dict[str, int] = field(default_factory=dict)  # reason kind -> groups
    skipped_groups: list[dict[str, str]] = field(default_factory=list)  # first MAX_LISTED {group, reason}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _leave(report: JudgeReport, why: str) -> None:
    report.left_alone[why] = report.left_alone.get(why, 0) + 1


def _skip(report: JudgeReport, group: str, reason: str) -> None:
    kind = reason.split(":")[0]
    report.skipped[kind] = report.skipped.get(kind, 0) + 1
    if len(report.skipped_groups) < MAX_LISTED:
        report.skipped_groups.append({"group": group, "reason": reason})


def run_judge(store: Any, client: JudgeClient, cfg: CurationConfig | None = None, *, since: datetime | None = None,
              tenant: str | None = None, log: Callable[[str], None] = lambda m: None) -> JudgeReport:
    """Judge the store's eligible traces (created at or after `since`; `tenant`'s, or every
    tenant's) and store the scores; returns what happened, every skip counted with its reason."""
    cfg = cfg or CurationConfig()
    jcfg = cfg.judge
    report = JudgeReport(judge=client.model, mode=jcfg.mode)
    attempts = []
    for trace in store.iter_traces(since=since, tenant=tenant):
        report.traces += 1
        got = attempt_of(trace, cfg)
        if isinstance(got, str):
            _leave(report, got)
        else:
            attempts.append(got)
    groups, alone = group_attempts(attempts, jcfg)
    for _ in alone:
        _leave(report, "alone (judge.singletons: skip)")
    report.groups = len(groups)
    for g in groups:
        report.groups_by_kind[g.kind] = report.groups_by_kind.get(g.kind, 0) + 1
    log(f"judging {len(groups)} groups of {len(attempts)} traces with {client.model} ({jcfg.mode})")
    for result in judge_groups(client, groups, jcfg):
        report.retried_groups += result.asked == 2
        if result.answer is None:
            _skip(report, result.group.id, result.reason or "skipped")
            continue
        report.judged_groups += 1
        _store_scores(store, result, client.model, cfg, report)
    return report


def _store_scores(store: Any, result: GroupResult, model: str, cfg: CurationConfig, report: JudgeReport) -> None:
    group = result.group
    for trace_id, body in feedback_bodies(group, result.answer, model, cfg.judge):
        try:
            store.add_feedback(trace_id, body, tenant=group.tenant)
        except IdempotencyConflict as e:  # the same judge, rubric and group scored it otherwise before
            _skip(report, group.id, f"conflict: {e}")
            continue
        report.scores_written += 1
        v = verdict(StoredFeedback(id="", trace_id=trace_id, created_at=datetime.min, score=body["score"],
                                   source="judge"), cfg)
        report.verdicts[v] += 1
