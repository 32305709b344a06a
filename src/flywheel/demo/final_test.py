"""The demo's independent final test: per family, tasks that no decision and no training sees.

The gate's figures are the candidate's scores on the suites that decide its promotion, so they
cannot also be the demo's evidence of what users gained. Each family therefore gets a frozen
final test:
- it comes from the environment's test split, whose problems are never train problems (a hash
  of the problem, envs/splits.py); the traffic users send, hence every trace curation trains
  on, comes from the train split;
- it leaves out every problem of the gate's frozen suite for that family
  (`Environment.problem_key`), so it shares nothing with what the gate decides on.
The demo scores production on it at the start and after every cycle that changed production,
and never passes it to the gate. Its cost is the demo's measuring apparatus, not the
flywheel's work: it goes in no ledger.
"""

from __future__ import annotations

from pathlib import Path

from flywheel.loop.evaluation import Suite, evaluate_model

FINAL_SEED = 7  # the test split's draw for the final tests; the gate's suites draw with their own seed


def final_suites(gate_suites: dict[str, Suite], n: int, max_tokens: int) -> dict[str, Suite]:
    """family -> its final test: `n` tasks of the gate suite's environment (same settings),
    test split, none of whose problems is in that gate suite. ValueError when the test split
    cannot spare `n` such tasks."""
    out = {}
    for name, gate in gate_suites.items():
        env = gate.env
        taken = {env.problem_key(t) for t in gate.tasks}
        in_gate = len(taken)
        try:
            drawn = env.tasks("test", n=n + in_gate, seed=FINAL_SEED)
        except ValueError as e:
            raise ValueError(f"final test of {name!r}: {e}") from None
        tasks = []
        for t in drawn:  # each problem once, none of the gate's
            key = env.problem_key(t)
            if key not in taken and len(tasks) < n:
                tasks.append(t)
                taken.add(key)
        if len(tasks) < n:
            raise ValueError(f"final test of {name!r}: the test split holds only {len(tasks)} tasks besides the "
                             f"gate suite's {in_gate}, fewer than the {n} asked for")
        out[name] = Suite(f"final/{name}", env, tasks, max_tokens)
    return out


def score(model_dir: str | Path, suites: dict[str, Suite]) -> dict[str, float]:
    """family -> greedy success of the model on its final test."""
    result = evaluate_model(model_dir, list(suites.values()))
    return {name: result.scores[s.name] for name, s in suites.items()}


def mean_gain_points(before: dict[str, float], after: dict[str, float]) -> float:
    """The change of the mean final-test success over every family, in points:
    mean_gain_points({'a': .5, 'b': .2}, {'a': .6, 'b': .2}) == 5.0."""
    if set(before) != set(after) or not before:
        raise ValueError(f"final-test scores of different families: {sorted(before)} vs {sorted(after)}")
    return 100 * sum(after[f] - before[f] for f in before) / len(before)
