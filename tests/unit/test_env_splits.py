"""Train and test splits disjoint by construction (envs/splits.py): a problem's side is a hash of
its canonical form, so under every setting the environments ship with, and those the demo, the
benchmarks and the configs use, no train task is a test problem; `flywheel rl` refuses eval
tasks that repeat train problems."""

from __future__ import annotations

import hashlib
import json
import warnings

import pytest

from flywheel.config import RLConfig, validate
from flywheel.demo.world import FAMILIES
from flywheel.envs import load_env
from flywheel.envs.arithmetic import split_pairs, side_of_prompt
from flywheel.envs.calculator import canonical_expression, side_of_expression
from flywheel.envs.code_repair import CodeRepairEnvironment, instance_key
from flywheel.envs.reasoning_gym import side_of_question
from flywheel.envs.repo import CodeRepairError, Instance
from flywheel.envs.replay import records_of
from flywheel.envs.splits import TEST_FRACTION, eval_overlap, side_of, split_score
from flywheel.envs.verifier_task import verifier_task_example
from flywheel.errors import TrainError
from flywheel.models.loading import ModelLoadError
from flywheel.train.rl import run_rl
from flywheel.types import Task

# ---------------------------------------------------------------- the rule


def test_split_score_is_the_sha256_fraction_and_a_fifth_is_test():
    for key in ("", "calculator\0(12 * 57)", "ünïcode"):
        expected = int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) / 2 ** 64
        assert split_score(key) == expected
        assert side_of(key) == ("test" if expected < TEST_FRACTION else "train")
    sides = [side_of(f"k{i}") for i in range(20_000)]
    assert 0.19 < sides.count("test") / len(sides) < 0.21
    assert side_of("k1", 0.0) == "train" and side_of("k1", 1.0) == "test"
    with pytest.raises(ValueError, match="test_fraction"):
        side_of("k", 1.5)


def task(id_: str, prompt: str) -> Task:
    return Task(id=id_, prompt=prompt, answer="0")


def test_eval_overlap_counts_shared_problems_and_names_one():
    train = [task("a", "1+1="), task("b", "2+2="), task("c", "3+3=")]
    key = lambda t: t.prompt  # noqa: E731
    none = eval_overlap(train, [task("x", "4+4="), task("y", "5+5=")], key)
    assert not none and none.total == 2 and not none.whole and "share no problem" in none.message()
    part = eval_overlap(train, [task("x", "4+4="), task("y", "2+2="), task("z", "3+3=")], key)
    assert part and (part.shared, part.total, part.example) == (2, 3, ("y", "b", "2+2=")) and not part.whole
    assert part.message().startswith("2 of the 3 eval (test) tasks are also train tasks")
    assert "'y'" in part.message() and "'b'" in part.message() and "'2+2='" in part.message()
    whole = eval_overlap(train, train[:2], key)
    assert whole.whole and whole.shared == 2
    assert not eval_overlap([], [], key).whole


# ---------------------------------------------------------------- calculator

FROM_MEMORY = {"chain_prob": 0.0, "bare_prompt": True, "max_turns": 3, "operator": "*",  # tests/integration/
               "template": "What is {a} times {b}?", "max_digits": 2}  # warm_starts.CALCULATOR_FROM_MEMORY
BENCH_ASYNC = {"chain_prob": 0.0, "bare_prompt": True, "max_turns": 3, "operator": "+",  # bench/async.py
               "template": "What is {a} + {b}?", "max_digits": 3}
CALCULATOR_SETTINGS = {
    "defaults": {},
    "chain_prob 0 (configs/calculator_grpo.yaml, sft_calculator.yaml, loop.yaml)": {"chain_prob": 0.0},
    **{f"demo family {f.name}": f.settings for f in FAMILIES},  # also configs/loop_calculator.yaml's suites
    **{f"demo base demos, max_digits {d}": {**FAMILIES[0].settings, "max_digits": d} for d in (2, 3, 4)},
    "calculator from memory (bench/async.py RL, test_rl_calculator.py)": FROM_MEMORY,
    "bench/async.py throughput": BENCH_ASYNC,
    "small, chained": {"max_digits": 2, "chain_prob": 1.0, "operator": "-"},
    "small, half chained": {"max_digits": 2, "chain_prob": 0.5, "operator": "+"},
}
# (n, seed) as they are drawn: the demo's 4,200 traffic questions per family (demo/run.py, seed 0),
# run_rl's train list (n=None: 5,000, seed train.seed) and its eval (n=eval.tasks, seed 0), suites of 200
TRAIN_DRAWS, TEST_DRAWS = [(4200, 0), (None, 0), (1000, 1)], [(200, 0), (100, 0), (50, 0), (16, 0)]


def plain_key(expression: str) -> tuple | None:
    """An independent canonical form of "a op b": operands in order for + and *."""
    parts = expression.split(" ")
    if len(parts) != 3:
        return None
    a, op, b = int(parts[0]), parts[1], int(parts[2])
    return (op, *sorted((a, b))) if op in "+*" else (op, a, b)


@pytest.fixture(scope="module")
def calculator_draws():
    """setting -> (train tasks, test tasks) over all the draws above."""
    out = {}
    for name, settings in CALCULATOR_SETTINGS.items():
        env = load_env("calculator", **settings)
        train = [t for n, seed in TRAIN_DRAWS for t in env.tasks("train", n=n, seed=seed)]
        test = [t for n, seed in TEST_DRAWS for t in env.tasks("test", n=n, seed=seed)]
        out[name] = env, train, test
    return out


@pytest.mark.parametrize("name", list(CALCULATOR_SETTINGS))
def test_calculator_train_and_test_share_no_problem(calculator_draws, name):
    env, train, test = calculator_draws[name]
    assert len(train) == 4200 + 5000 + 1000 and len(test) == 200 + 100 + 50 + 16
    for tasks in (train, test):
        one_draw = tasks[:4200] if tasks is train else tasks[:200]
        assert len({t.metadata["expression"] for t in one_draw}) == len(one_draw)  # distinct within a draw
    train_keys = {env.problem_key(t) for t in train}
    assert not train_keys & {env.problem_key(t) for t in test}
    assert not {t.metadata["expression"] for t in train} & {t.metadata["expression"] for t in test}
    assert not {t.prompt[-1]["content"] for t in train} & {t.prompt[-1]["content"] for t in test}
    plain_train = {plain_key(t.metadata["expression"]) for t in train} - {None}
    assert not plain_train & ({plain_key(t.metadata["expression"]) for t in test} - {None})
    assert all(side_of_expression(t.metadata["expression"]) == t.split for t in train + test)
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}


def test_calculator_sides_agree_across_every_setting(calculator_draws):
    """The demo's base demos (max_digits 2-4) never hold a question of the add suite (max_digits 3)."""
    train = {env.problem_key(t) for env, tr, _ in calculator_draws.values() for t in tr}
    test = {env.problem_key(t) for env, _, te in calculator_draws.values() for t in te}
    assert not train & test and len(test) > 1000


@pytest.mark.parametrize("operator", ["*", "+", "-"])
def test_calculator_small_space_is_split_whole_and_refuses_more_than_it_holds(operator):
    env = load_env("calculator", chain_prob=0.0, max_digits=2, operator=operator)
    train = {t.metadata["expression"] for t in env.tasks("train", n=6000)}
    test = {t.metadata["expression"] for t in env.tasks("test", n=1500)}
    assert len(train) == 6000 and len(test) == 1500 and not train & test
    sides = {(a, b): side_of_expression(f"{a} {operator} {b}") for a in range(1, 100) for b in range(1, 100)}
    n_test = sum(s == "test" for s in sides.values())
    assert 1500 <= n_test <= 2500
    if operator in "+*":  # one problem, one side
        assert all(sides[a, b] == sides[b, a] for a, b in sides)
    with pytest.raises(ValueError, match=f"the test split holds {n_test} problems, 3000 asked"):
        env.tasks("test", n=3000)
    with pytest.raises(ValueError, match="the train split holds"):
        env.tasks("train", n=9801 - n_test + 1)


def test_calculator_canonical_expression_orders_commutative_operands():
    assert canonical_expression("57 * 12") == canonical_expression("12 * 57") == "(12 * 57)"
    assert canonical_expression("(12 * 57 + 100) * 5") == canonical_expression("5 * (100 + 57 * 12)")
    assert canonical_expression("57 - 12") != canonical_expression("12 - 57")
    env = load_env("calculator")
    made = Task(id="x", prompt="?", answer="684", metadata={"expression": "57 * 12"})
    assert env.problem_key(made) == "(12 * 57)"
    assert env.problem_key(Task(id="y", prompt="What?", answer="1")) == '"What?"'  # no expression: the prompt


# ---------------------------------------------------------------- arithmetic

ARITHMETIC_SETTINGS = [  # defaults: bench/rl_vs_trl.py, configs/arith_grpo.yaml, configs/loop.yaml, bench/async.py
    {}, {"heldout": 100}, {"operators": "+-", "digits": 2}, {"operators": "-", "digits": 2},
    {"operators": "+", "digits": 3}, {"operators": "+-*", "digits": 3}, {"operators": "*", "digits": 6},
    *({"operators": ops, "digits": 1} for ops in ("+", "-", "*", "+-", "+*", "-*", "+-*")),
]


@pytest.fixture(scope="module")
def arithmetic_splits():
    return [(s, load_env("arithmetic", **s)) for s in ARITHMETIC_SETTINGS]


@pytest.mark.parametrize("index", range(len(ARITHMETIC_SETTINGS)))
def test_arithmetic_train_and_test_share_no_problem(arithmetic_splits, index):
    settings, env = arithmetic_splits[index]
    train, test = env.tasks("train"), env.tasks("test")
    assert len(test) >= 10 and len(train) >= 3 * len(test)
    assert len(test) <= settings.get("heldout", 200)
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    assert not {env.problem_key(t) for t in train} & {env.problem_key(t) for t in test}
    assert all(side_of_prompt(t.prompt) == t.split for t in train + test)


def test_arithmetic_sides_agree_across_settings_and_keep_the_peer_split(arithmetic_splits):
    train = {t.prompt for _, env in arithmetic_splits for t in env.tasks("train")}
    test = {t.prompt for _, env in arithmetic_splits for t in env.tasks("test")}
    assert not train & test
    _, peer_test = split_pairs()
    peer_test_prompts = {f"{a:02d}+{b:02d}=" for a, b in peer_test}
    assert not peer_test_prompts & train  # no setting trains on the shared held-out pairs
    assert [t.prompt for t in load_env("arithmetic").tasks("test")] == [f"{a:02d}+{b:02d}=" for a, b in peer_test]
    assert {t.prompt for t in load_env("arithmetic", heldout=100).tasks("test")} < peer_test_prompts


# ---------------------------------------------------------------- reasoning_gym

RG_SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
            "allow_negation": False, "allow_parentheses": False}  # ~100 distinct questions


@pytest.mark.parametrize("dataset, settings", [("leg_counting", {}), ("letter_counting", {}),
                                               ("basic_arithmetic", RG_SMALL)])
def test_reasoning_gym_train_and_test_share_no_question_across_sizes(dataset, settings):
    envs = [load_env("reasoning_gym", dataset=dataset, size=size, test_size=test_size, **settings)
            for size, test_size in ((60, 20), (300, 50))]
    question = lambda t: t.prompt[1]["content"]  # noqa: E731
    train = [t for env in envs for t in env.tasks("train")]
    test = [t for env in envs for t in env.tasks("test")]
    assert test and not {question(t) for t in train} & {question(t) for t in test}
    assert not {envs[0].problem_key(t) for t in train} & {envs[0].problem_key(t) for t in test}
    assert all(side_of_question(question(t)) == t.split for t in train + test)
    for env in envs:
        tr, te = env.splits()
        assert len(tr) == env.size and len({question(t) for t in te}) == len(te)
        if not settings:  # large question spaces fill both sizes
            assert len(te) == env.test_size


# ---------------------------------------------------------------- code_repair


def instance(i: int | str, statement: str | None = None, split: str | None = None, bug: str | None = None) -> Instance:
    return Instance(instance_id=f"inst-{i}", repo="minilib", base_commit="", patch="diff --git a/x b/x\n",
                    problem_statement=statement or f"bug {i}", test_patch="", FAIL_TO_PASS=["tests/t.py::t"],
                    PASS_TO_PASS=[], bug_patch=bug if bug is not None else f"bug-patch {i}\n", split=split)


def test_code_repair_one_problem_is_on_one_side_whatever_its_ids():
    instances = [instance(i) for i in range(60)]
    copies = [instance(f"{i}-copy{c}", statement=f"bug {i}", bug=f"bug-patch {i}\n") for i in range(10) for c in (1, 2)]
    env = CodeRepairEnvironment(instances + copies, "mem")
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) + len(test) == 80 and 4 <= len(test) <= 30
    assert not {env.problem_key(t) for t in train} & {env.problem_key(t) for t in test}
    assert not {t.id for t in train} & {t.id for t in test}
    sides = {t.id: t.split for t in train + test}
    assert all(sides[f"inst-{i}-copy{c}"] == sides[f"inst-{i}"] for i in range(10) for c in (1, 2))
    assert env.problem_key(train[0]) == instance_key("minilib", train[0].metadata["instance"]["bug_patch"],
                                                     train[0].metadata["instance"]["problem_statement"])


def test_code_repair_a_marked_split_binds_its_problem_and_a_conflict_is_refused():
    key = lambda i: instance_key("minilib", f"bug-patch {i}\n", f"bug {i}")  # noqa: E731
    i = next(i for i in range(100) if side_of("code_repair\0" + key(i)) == "train")
    env = CodeRepairEnvironment([instance(i, split="test"), instance(f"{i}-copy", statement=f"bug {i}",
                                                                     bug=f"bug-patch {i}\n"), instance(1000)], "mem")
    assert {t.id for t in env.tasks("test")} >= {f"inst-{i}", f"inst-{i}-copy"}
    with pytest.raises(CodeRepairError, match="one problem .* marked with different splits"):
        CodeRepairEnvironment([instance(i, split="test"), instance(f"{i}-copy", statement=f"bug {i}",
                                                                   bug=f"bug-patch {i}\n", split="train")], "mem")


def test_code_repair_small_files_keep_both_splits_and_one_instance_has_no_test():
    on_train = [i for i in range(200) if side_of("code_repair\0" + instance_key("minilib", f"bug-patch {i}\n",
                                                                                 f"bug {i}")) == "train"]
    pair = CodeRepairEnvironment([instance(on_train[0]), instance(on_train[1])], "mem")
    (train,), (test,) = pair.tasks("train"), pair.tasks("test")  # the hash put both on train: one moved
    assert train.id != test.id
    alone = CodeRepairEnvironment([instance(on_train[0])], "one.jsonl")
    assert [t.id for t in alone.tasks("train")] == [f"inst-{on_train[0]}"]
    with pytest.raises(CodeRepairError, match="one.jsonl: no test instance among 1"):
        alone.tasks("test")
    assert verifier_task_example(alone)["metadata"]["instance"]["instance_id"] == f"inst-{on_train[0]}"


# ---------------------------------------------------------------- flywheel rl refuses held-out tasks that are not


def replay_files(tmp_path, train_prompts, test_prompts):
    paths = []
    for name, prompts in (("train", train_prompts), ("test", test_prompts)):
        tasks = [Task(id=f"{name}-{i}", prompt=p, answer="0") for i, p in enumerate(prompts)]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records_of(tasks, "arithmetic")))
        paths.append(str(path))
    return paths


def rl_config(tmp_path, train, test) -> RLConfig:
    return validate(dict(model=str(tmp_path / "no-model"), output_dir=str(tmp_path / "out"),
                         env={"name": "replay", "settings": {"train": train, "test": test}},
                         eval={"tasks": 10}, log={"progress": False}), RLConfig)


def test_run_rl_refuses_eval_tasks_that_repeat_some_train_problems(tmp_path):
    train, test = replay_files(tmp_path, ["1+1=", "2+2=", "3+3="], ["2+2=", "4+4=", "5+5="])
    with pytest.raises(TrainError, match=r"1 of the 3 eval \(test\) tasks are also train tasks.*'test-0'.*'train-1'"):
        run_rl(rl_config(tmp_path, train, test), log=lambda m: None)


def test_run_rl_warns_when_every_eval_task_is_a_train_task_and_is_silent_when_disjoint(tmp_path):
    train, test = replay_files(tmp_path, ["1+1=", "2+2=", "3+3="], ["2+2=", "3+3="])
    logged: list[str] = []
    with pytest.warns(UserWarning, match="every eval task is a train task"), pytest.raises(ModelLoadError):
        run_rl(rl_config(tmp_path, train, test), log=logged.append)  # the check passes on to loading the model
    assert any(m.startswith("warning: env 'replay': every eval task") for m in logged)
    train, test = replay_files(tmp_path, ["1+1=", "2+2="], ["4+4=", "5+5="])
    logged.clear()
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ModelLoadError):
        warnings.simplefilter("always")
        run_rl(rl_config(tmp_path, train, test), log=logged.append)
    assert not [w for w in caught if "eval task" in str(w.message)] and not any("eval task" in m for m in logged)
