"""The one evaluator and the one player, worked by hand: a scripted sampler (byte ids, fixed
completions per prompt) on a three-task raw-text env whose episodes report chosen metrics."""

from __future__ import annotations

import asyncio
from typing import Sequence

import pytest

from flywheel.envs.base import Env, EnvGroupBuilder, Environment, Policy, StepResult
from flywheel.inference import Sample, SamplingParams
from flywheel.rollout.evaluate import evaluate
from flywheel.rollout.play import SamplerPolicy, play
from flywheel.types import Task

# prompt -> the greedy completion, then the sampled ones in the order they are drawn
SCRIPT = {"1+1=": ["2", "0", "2"], "2+2=": ["five", "5", "7"], "3+3=": ["6", "1", "1"]}


class Sums(Environment):
    """One turn: reward 1 for the exact answer. Every episode reports `length` (characters of
    the answer); only a wrong one reports `wrong` = 1."""

    name = "sums"

    def tasks(self, split="test", n=None, seed=0):
        return [Task(id=p, prompt=p, answer=str(2 * int(p[0]))) for p in SCRIPT][:n]

    def make_env(self, task):
        return _SumEnv(task)


class _SumEnv(Env):
    def __init__(self, task: Task):
        self.task = task

    async def initial_observation(self):
        return self.task.prompt

    async def step(self, action: str) -> StepResult:
        ok = action == self.task.answer
        metrics = {"length": float(len(action)), **({} if ok else {"wrong": 1.0})}
        return StepResult([], float(ok), True, metrics)


class ScriptedSampler:
    """A Sampler that answers each prompt from SCRIPT: greedy calls give the first completion,
    sampled calls the next unused ones. Token ids are UTF-8 bytes; each token's logprob is -1."""

    version = 0

    def __init__(self):
        self.sampled = {p: iter(c[1:]) for p, c in SCRIPT.items()}
        self.calls: list[tuple[int, float]] = []  # (prompts, temperature) per generate call

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Sample]]:
        self.calls.append((len(prompts), params.temperature))
        out = []
        for i, ids in enumerate(prompts):
            prompt = bytes(ids).decode()
            text = SCRIPT[prompt][0] if params.temperature == 0 else next(self.sampled[prompt])
            tokens = list(text.encode())
            out.append([Sample(tokens, [-1.0] * len(tokens), "stop", self.version, i, text=text)])
        return out


def test_evaluate_scores_greedy_episodes_and_averages_the_env_metrics():
    sampler = ScriptedSampler()
    result = evaluate(sampler, Sums(), Sums().tasks(), max_tokens=8)
    assert result.success == 2 / 3  # "2" and "6" right, "five" wrong
    assert result.passed == (True, False, True)  # per task, in task order: what the gate pairs
    assert result.metrics == {"length": (1 + 4 + 1) / 3, "wrong": 1 / 3}  # 0 where an episode lacks it
    assert result.episodes == 3 and result.tokens_generated == 6 and result.pass_at_k is None
    assert sampler.calls == [(3, 0.0)]  # one greedy generate call for all episodes


def test_evaluate_adds_pass_at_k_from_sampled_groups():
    sampler = ScriptedSampler()
    result = evaluate(sampler, Sums(), Sums().tasks(), max_tokens=8, pass_k=2,
                      sampling=SamplingParams(temperature=1.0, max_tokens=8))
    # sampled: 1+1= "0", "2" (one right); 2+2= "5", "7"; 3+3= "1", "1"
    assert result.pass_at_k == 1 / 3 and result.success == 2 / 3
    assert sampler.calls == [(3, 0.0), (6, 1.0)]
    with pytest.raises(ValueError, match="pass@k needs"):
        evaluate(ScriptedSampler(), Sums(), Sums().tasks(), max_tokens=8, pass_k=2)


def test_evaluate_on_no_tasks_is_zero():
    result = evaluate(ScriptedSampler(), Sums(), [], max_tokens=8)
    assert (result.success, result.metrics, result.episodes, result.tokens_generated, result.passed) == (0.0, {}, 0, 0, ())


def test_a_sampler_episode_keeps_the_sampled_ids_masked_and_in_task_order():
    (a, b) = asyncio.run(play(Sums(), Sums().tasks(n=2), SamplerPolicy.greedy(ScriptedSampler(), 8)))
    assert [g.task_id for g in (a, b)] == ["1+1=", "2+2="]
    (t,) = b.trajectories
    assert t.ids == list(b"2+2=five") and t.loss_mask == [0] * 4 + [1] * 4
    assert t.behavior_logprobs == [0.0] * 4 + [-1.0] * 4 and t.versions == [-1] * 4 + [0] * 4
    assert t.reward == 0.0 and t.metrics == {"length": 4.0, "wrong": 1.0}


def test_a_sampler_episode_generates_on_the_thread_that_plays_it():
    """Not on an executor thread: the thread that built the engine runs its forwards, so the
    process's torch work keeps one OpenMP team (flywheel/threads.py)."""
    import threading

    threads = []

    class Recording(ScriptedSampler):
        def generate(self, prompts, params):
            threads.append(threading.get_ident())
            return super().generate(prompts, params)

    asyncio.run(play(Sums(), Sums().tasks(), SamplerPolicy.greedy(Recording(), 8)))
    assert threads == [threading.get_ident()]


class Centred(Sums):
    """Group rewards: each member's reward minus its group's mean."""

    def group_builder(self, task, n):
        class Centre(EnvGroupBuilder):
            async def group_rewards(self, rewards, transcripts):
                return [r - sum(rewards) / len(rewards) for r in rewards]
        return Centre(self.make_env, task, n)


class Alternating(Policy):
    """Right on even calls, wrong on odd ones."""

    def __init__(self):
        self.n = 0

    async def act(self, task, history, tools, episode=0):
        self.n += 1
        return task.answer if self.n % 2 else "x"


def test_a_text_policy_plays_groups_with_the_builders_rewards():
    results = asyncio.run(play(Centred(), Centred().tasks(n=2), Alternating(), group_size=2, concurrency=1))
    assert [r.task.id for r in results] == ["1+1=", "1+1=", "2+2=", "2+2="]
    assert [r.transcript for r in results] == ["1+1=2", "1+1=x", "2+2=4", "2+2=x"]
    assert [r.reward for r in results] == [0.5, -0.5, 0.5, -0.5] and all(r.error is None for r in results)
