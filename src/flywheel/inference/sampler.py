"""The Sampler protocol: what every inference backend (local torch engine, vLLM, a remote
OpenAI-compatible server) offers to rollouts, evaluation and serving.

Token in, token out: prompts are token ids, samples are token ids with per-token logprobs
and the version of the weights that produced them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping, Protocol, Sequence, runtime_checkable

FinishReason = Literal["stop", "length", "cancelled"]  # cancelled: its caller aborted it


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature=0` is greedy decoding.

    Logprobs (`logprobs_mode`):
      - "raw" (default): log p(token | prefix) under the model's own distribution, i.e.
        log_softmax of the fp32 logits at temperature 1 with no top-k / top-p filtering.
        This is what a learner's forward pass computes for the same tokens, so RL
        importance ratios compare like with like.
      - "processed": log-probability under the distribution actually sampled from, after
        temperature scaling and top-k / top-p renormalisation (greedy rows: under the
        temperature-1 distribution, as there is no sampling distribution).
    `top_logprobs=k` (> 0) also returns, for every sampled token, the k most likely tokens
    of the tokenizer's vocabulary under that same distribution (`Sample.top_logprobs`);
    0 costs nothing.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's eos ids
    stop: tuple[str, ...] = ()  # stop strings; the text excludes them, the ids keep the token
    ignore_eos: bool = False
    logprobs_mode: Literal["raw", "processed"] = "raw"
    top_logprobs: int = 0  # alternatives per sampled token; 0 = none

    def __post_init__(self):
        problems = []
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(f"stop strings must be non-empty strings, got {self.stop!r}")
        if self.logprobs_mode not in ("raw", "processed"):
            problems.append(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if not isinstance(self.top_logprobs, int) or self.top_logprobs < 0:
            problems.append(f"top_logprobs must be an integer >= 0, got {self.top_logprobs!r}")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))
        # accept lists from JSON / YAML
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class Sample:
    """One completion. `token_ids[i]` was sampled with log-probability `logprobs[i]`
    (see SamplingParams for the distribution). When a stop token or stop string ended the
    sample, the token that did it is the last of `token_ids`; `text` excludes a stop string
    (OpenAI semantics) but keeps nothing after it. With `SamplingParams.top_logprobs=k`,
    `top_logprobs[i]` holds token i's alternatives: up to k (id, logprob) pairs, best first,
    under the distribution of `logprobs[i]` (tokens outside a filtered support left out).
    `version` is the weights' version that produced the first token; an engine that lets
    weights change while a sample decodes tags each token in `token_versions`."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version: int
    prompt_index: int
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text: str | None = None
    prompt_len: int = 0
    extra: dict = field(default_factory=dict)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    token_versions: list[int] | None = None  # per token, when weights changed mid-sample; None: all `version`


@runtime_checkable
class Sampler(Protocol):
    """Generates samples for token prompts and takes new weights by version."""

    version: int

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[list[Sample]]:
        """For prompt i, `params[i].n` samples (a single SamplingParams applies to all)."""
        ...

    def update_weights(self, tensors: Mapping[str, "object"], version: int) -> None:
        """Replace (some of) the weights by name and set the version of what follows."""
        ...
