"""Token-level rollouts through the Env API with the local engine."""

import asyncio

import pytest
import torch

from flywheel.envs import load_env
from flywheel.inference import LocalEngine, SamplingParams
from flywheel.models import ChatRenderer, TinySpec, build_tiny_model, load
from flywheel.rollout.play import SamplerPolicy, play


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), TinySpec(hidden=64, layers=2, heads=4, ffn=128, seed=1))


def test_raw_task_groups(model_dir):
    engine = LocalEngine.from_path(str(model_dir), seed=0, version=3)
    env = load_env("arithmetic")
    tasks = env.tasks("test", n=2)
    groups = asyncio.run(play(env, tasks, SamplerPolicy(engine, SamplingParams(max_tokens=4)), group_size=4))
    assert [g.task_id for g in groups] == [t.id for t in tasks] and all(len(g.trajectories) == 4 for g in groups)
    model, _ = load(model_dir)
    for g, task in zip(groups, tasks):
        prompt = engine.encode(task.prompt)
        for t in g.trajectories:
            assert t.ids[:len(prompt)] == prompt
            assert t.loss_mask == [0] * len(prompt) + [1] * (len(t.ids) - len(prompt))
            assert set(v for v, m in zip(t.versions, t.loss_mask) if m) == {3}
            with torch.no_grad():
                lp = model(torch.tensor([t.ids])).logits[0, :-1].log_softmax(-1)
            ref = lp.gather(-1, torch.tensor(t.ids[1:])[:, None])[:, 0]
            got = torch.tensor(t.behavior_logprobs[1:])
            sampled = torch.tensor(t.loss_mask[1:]).bool()
            assert torch.allclose(ref[sampled], got[sampled], atol=1e-4)
            assert t.reward in (0.0, 1.0)


def test_chat_tool_episodes_keep_sampled_ids(model_dir):
    engine = LocalEngine.from_path(str(model_dir), seed=0)
    renderer = ChatRenderer(engine.tokenizer)
    env = load_env("calculator", max_turns=2)
    tasks = env.tasks("test", n=1)
    # a random model rarely emits a well-formed call; episodes still end within max_turns
    groups = asyncio.run(play(env, tasks, SamplerPolicy(engine, SamplingParams(max_tokens=12), renderer), group_size=2))
    for t in groups[0].trajectories:
        assert len(t.ids) == len(t.loss_mask) == len(t.behavior_logprobs) == len(t.versions)
        prompt = renderer.prompt_ids(tasks[0].prompt, tasks[0].tools)
        assert t.ids[:len(prompt)] == prompt  # the first prompt is the template's
        assert sum(t.loss_mask) > 0 and t.loss_mask[:len(prompt)] == [0] * len(prompt)
        assert 1 <= t.metrics["turns"] <= 2


class ScriptedSampler:
    """A Sampler that replays fixed assistant texts (turn by turn) through the real tokenizer."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.calls, self.version = tokenizer, turns, 0, 7

    def encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts, params):
        from flywheel.inference import Sample

        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = self.encode(text) + [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return [[Sample(ids, [-0.5] * len(ids), "stop", self.version, i, text=text)] for i, _ in enumerate(prompts)]


def test_multi_turn_masks_tool_tokens(model_dir):
    from flywheel.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    env = load_env("calculator")
    task = env.tasks("test", n=1)[0]
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "%s"}}\n</tool_call>' % task.metadata["expression"]
    sampler = ScriptedSampler(tok, [call, f"The answer is {task.answer}."])
    renderer = ChatRenderer(tok)
    (group,) = asyncio.run(play(env, [task], SamplerPolicy(sampler, SamplingParams(), renderer)))
    t = group.trajectories[0]
    assert t.reward == 1.0 and t.metrics["tool_calls"] == 1.0
    # the episode's ids are exactly the rendered conversation (sampled ids kept as they were)
    messages = [*task.prompt, {"role": "assistant", "content": call},
                {"role": "tool", "content": task.answer}, {"role": "assistant", "content": f"The answer is {task.answer}."}]
    full = renderer.encode(renderer.render(messages, task.tools))
    assert t.ids == full[:len(t.ids)] and len(full) - len(t.ids) == 1  # only the template's final newline
    # mask: two sampled runs, with the tool response between them untrained
    runs, prev = [], 0
    for i, m in enumerate(t.loss_mask):
        if m and not prev:
            runs.append([i, i])
        if m:
            runs[-1][1] = i
        prev = m
    assert len(runs) == 2
    between = tok.decode(t.ids[runs[0][1] + 1:runs[1][0]])
    assert f"<tool_response>\n{task.answer}\n</tool_response>" in between
    assert set(v for v, m in zip(t.versions, t.loss_mask) if m) == {7}


def test_per_token_versions_reach_the_trajectory(model_dir):
    """A sample whose weights changed mid-decode (Sample.token_versions) keeps each token's version."""
    from flywheel.models import load_tokenizer

    class Updating(ScriptedSampler):
        def generate(self, prompts, params):
            out = super().generate(prompts, params)
            for (s,) in out:
                s.token_versions = [7] * 2 + [8] * (len(s.token_ids) - 2)
            return out

    tok = load_tokenizer(model_dir)
    env = load_env("calculator")
    task = env.tasks("test", n=1)[0]
    sampler = Updating(tok, [f"The answer is {task.answer}."])
    (group,) = asyncio.run(play(env, [task], SamplerPolicy(sampler, SamplingParams(), ChatRenderer(tok))))
    t = group.trajectories[0]
    trained = [v for v, m in zip(t.versions, t.loss_mask) if m]
    assert trained == [7, 7] + [8] * (len(trained) - 2) and len(trained) > 2
    assert set(v for v, m in zip(t.versions, t.loss_mask) if not m) == {-1}
