"""How far a judge model agrees with an environment's verifier, where both exist.

For each environment (calculator, code_repair), each of `--groups` test tasks gets a group of
`--n` episodes: n // 2 from the environment's scripted solver (env.scripted_policy():
calculator's ScriptedCalculatorPolicy, code_repair's GoldPatchPolicy, which the verifier
passes) and the rest from a policy model (temperature 1, the env's tools; a small one mostly
fails), so every group holds pairs the verifier separates. A group's members are shuffled with
a fixed seed (`--seed`), so an answer's position does not tell its source (RULER-style judges
are position-biased). The env's verifier grades each episode (pass = reward >= 1). The judge
then scores the same episodes as flywheel's judge scores traces (loop/judging.py, in process
through SamplerJudge):
  ranking: each task's episodes side by side (RULER-style), greedy JSON reply.
  rubric:  each episode alone, greedy JSON reply.
  verdict: each episode alone, asked "Does the answer correctly and fully solve the task?
           Answer yes or no."; score = P(yes) / (P(yes) + P(no)) from one forward pass: no
           text, so no malformed reply (judges too small to write JSON).
Per mode, over the episodes it scored: pairwise agreement = of the pairs of one task's episodes
the verifier separates (one passed, one failed), the share the judge orders the same way (a tie
counts as not agreeing); accuracy and Cohen's kappa of score >= --threshold against the
verifier's pass/fail; AUROC of the score against the verifier's pass (no threshold; pooled over
tasks; ties count half). Ranking scores are relative to their group, so its thresholded figures
are shown but mean less. Groups whose JSON reply was malformed twice are skipped (as in
production) and counted. Judges: SmolLM2-135M-Instruct (when `flywheel model fetch
smollm2-135m-instruct` has cached it) and the untrained tiny model as a floor. The scripted
solver's answers are templated, so a judge may tell them apart by style as well as by
correctness: the figures bound how well the judge separates right from wrong, from above.

Tiny run: python bench/judge_agreement.py --groups 2 --n 2 --no-report
Full run: python bench/judge_agreement.py --groups 16 --n 4 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


MODES = ("ranking", "rubric", "verdict")


def _turns(task, ep) -> tuple[list[dict], bool]:
    if isinstance(ep.transcript, str):
        turns = [{"role": "assistant", "content": ep.transcript[len(task.prompt):]}]
    else:
        turns = list(ep.transcript[len(task.prompt):]) or [{"role": "assistant", "content": ""}]
    return turns, ep.error is None and ep.reward >= 1.0


def play_groups(env, tasks, engine, n: int, max_tokens: int, seed: int):
    """[(task, [(turns after the prompt, verifier passed, source)] * n)] for each task: n // 2
    episodes of the env's scripted solver and n - n // 2 of the model, shuffled with `seed`."""
    from flywheel.envs.model_policy import ModelPolicy
    from flywheel.inference import SamplingParams
    from flywheel.rollout.play import play

    scripted_n = n // 2
    policy = ModelPolicy(engine, SamplingParams(temperature=1.0, max_tokens=max_tokens))
    model_eps = asyncio.run(play(env, tasks, policy, group_size=n - scripted_n, timeout_s=600))
    scripted_eps = (asyncio.run(play(env, tasks, env.scripted_policy(), group_size=scripted_n, timeout_s=600))
                    if scripted_n else [])
    out = []
    for i, task in enumerate(tasks):
        group = [(*_turns(task, ep), "scripted") for ep in scripted_eps[i * scripted_n:(i + 1) * scripted_n]]
        group += [(*_turns(task, ep), "policy") for ep in model_eps[i * (n - scripted_n):(i + 1) * (n - scripted_n)]]
        random.Random(seed * 1_000_003 + i).shuffle(group)  # position tells no source
        out.append((task, group))
    return out


def judge_mode(judge, played, jcfg, mode: str):
    """judge_groups results of `mode` over `played`: ranking one group per task, rubric and
    verdict one per episode."""
    from flywheel.loop.judge import Attempt, group_attempts
    from flywheel.loop.judging import judge_groups

    attempts = [Attempt(f"{ti}-{k}", task.prompt, turns, seq=ti * 1000 + k, tools=task.tools)
                for ti, (task, answers) in enumerate(played) for k, (turns, _, _) in enumerate(answers)]
    cfg = jcfg.model_copy(update={"mode": mode})
    groups, _ = group_attempts(attempts, cfg)
    return judge_groups(judge, groups, cfg)


def auroc(scored: list[tuple[bool, float]]) -> float:
    """P(a passed episode's score > a failed one's), ties counted half; nan without both."""
    pos = [s for v, s in scored if v]
    neg = [s for v, s in scored if not v]
    if not pos or not neg:
        return math.nan
    return sum((p > q) + 0.5 * (p == q) for p in pos for q in neg) / (len(pos) * len(neg))


def agreement(played, results, threshold: float) -> dict:
    """One mode's figures against the verifier (see the module's docstring)."""
    passed = {f"{ti}-{k}": ok for ti, (_, answers) in enumerate(played) for k, (_, ok, _) in enumerate(answers)}
    score: dict[str, tuple[str, float]] = {}  # episode -> (the judge group it was scored in, its score)
    for r in results:
        if r.answer is not None:
            for m, s in zip(r.group.members, r.answer.scores):
                score[m.id] = (r.group.id, s)
    same_group = all(len(r.group.members) > 1 for r in results)  # ranking: pairs only within one judge call
    pairs = agree = ties = 0
    for ti, (_, answers) in enumerate(played):
        ids = [f"{ti}-{k}" for k in range(len(answers)) if f"{ti}-{k}" in score]
        for a, b in itertools.combinations(ids, 2):
            if passed[a] == passed[b] or (same_group and score[a][0] != score[b][0]):
                continue
            (sa, sb), va = (score[a][1], score[b][1]), passed[a]
            pairs += 1
            ties += sa == sb
            agree += sa != sb and (sa > sb) == va
    votes = [(passed[i], s >= threshold) for i, (_, s) in score.items()]
    n = len(votes)
    acc = sum(v == j for v, j in votes) / n if n else math.nan
    pv, pj = (sum(v for v, _ in votes) / n, sum(j for _, j in votes) / n) if n else (math.nan, math.nan)
    pe = pv * pj + (1 - pv) * (1 - pj)
    kappa = (acc - pe) / (1 - pe) if n and pe < 1 else math.nan
    return {"groups": len(results), "answered": sum(r.answer is not None for r in results), "pairs": pairs,
            "pairwise": agree / pairs if pairs else math.nan, "ties": ties, "scored": n, "accuracy": acc,
            "kappa": kappa, "auroc": auroc([(passed[i], s) for i, (_, s) in score.items()]),
            "skipped": sum(r.answer is None for r in results),
            "first_skip": next((r.reason for r in results if r.reason), None)}


def verifier_split(played) -> dict:
    """Episodes, and how many the verifier passed, by source; the pairs it separates within tasks."""
    out = {"scripted": [0, 0], "policy": [0, 0]}
    pairs = 0
    for _, answers in played:
        for _, ok, source in answers:
            out[source][0] += 1
            out[source][1] += ok
        p = sum(ok for _, ok, _ in answers)
        pairs += p * (len(answers) - p)
    return {"episodes": sum(e for e, _ in out.values()), "passed": sum(p for _, p in out.values()),
            "scripted": tuple(out["scripted"]), "policy": tuple(out["policy"]), "pairs": pairs}


def _judges(args) -> list[tuple[str, Path]]:
    from flywheel.models.packaged import fetched_folder

    out = []
    smol = fetched_folder("smollm2-135m-instruct")
    if (smol / "config.json").exists():
        out.append(("smollm2-135m-instruct", smol))
    else:
        print(f"SmolLM2 not cached at {smol} (flywheel model fetch smollm2-135m-instruct): tiny judge only",
              file=sys.stderr)
    out.append(("tiny (untrained floor)", common.tiny_model()))
    return out


def _f(v: float) -> str:
    return f"{v:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=16, help="test tasks per environment (one judge group each)")
    ap.add_argument("--n", type=int, default=4, help="episodes per task (>= 2): n // 2 scripted, the rest the model's")
    ap.add_argument("--envs", default="calculator,code_repair")
    ap.add_argument("--policy", default=None, help="the policy's model folder (default: SmolLM2 when cached, "
                                                   "else the tiny model)")
    ap.add_argument("--max-tokens", type=int, default=96, help="policy tokens per turn")
    ap.add_argument("--threshold", type=float, default=0.5, help="a score counted as the judge's pass")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="seeds the task choice and each group's order")
    ap.add_argument("--modes", default=",".join(MODES), help="judge modes to measure, of " + ", ".join(MODES))
    ap.add_argument("--no-report", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes {args.modes!r}: each of {', '.join(MODES)}")
    if args.n < 2:
        ap.error("--n must be at least 2 (half scripted, half the model's)")
    threads = common.set_threads(args.threads)
    from flywheel.envs import load_env
    from flywheel.inference import LocalEngine
    from flywheel.loop.judge_config import JudgeConfig
    from flywheel.loop.judging import SamplerJudge

    judges = _judges(args)
    policy_path = Path(args.policy) if args.policy else judges[0][1]
    policy = LocalEngine.from_path(str(policy_path))
    engines = {name: policy if Path(path) == policy_path else LocalEngine.from_path(str(path))
               for name, path in judges}  # the policy's engine judges too when it is the same model
    jcfg = JudgeConfig(max_tokens=96, max_chars=1500)
    rows, splits, last = [], {}, {}  # last: env -> {mode: the first judge's figures}, for the last line
    for env_name in args.envs.split(","):
        env = load_env(env_name)
        t0 = time.perf_counter()
        played = play_groups(env, env.tasks("test", n=args.groups, seed=args.seed), policy, args.n,
                             args.max_tokens, args.seed)
        splits[env_name] = (verifier_split(played), time.perf_counter() - t0)
        for judge_name, engine in engines.items():
            judge = SamplerJudge(engine, engine.tokenizer, judge_name)
            for mode in modes:
                t0 = time.perf_counter()
                results = judge_mode(judge, played, jcfg, mode)
                secs = time.perf_counter() - t0
                a = agreement(played, results, args.threshold)
                rows.append((env_name, judge_name, mode, a, secs))
                if judge_name == judges[0][0]:
                    last.setdefault(env_name, {})[mode] = a
    body = [f"Machine: {common.machine_line(threads)}. Each task's group: {args.n // 2} episode(s) of the env's "
            f"scripted solver (ScriptedCalculatorPolicy, GoldPatchPolicy) and {args.n - args.n // 2} of the policy "
            f"{policy_path.name} (temperature 1, {args.max_tokens} tokens a turn), shuffled with seed {args.seed}; "
            f"{args.groups} test tasks per environment. Judge: ranking and rubric greedy, {jcfg.max_tokens} reply "
            f"tokens; verdict P(yes) / (P(yes) + P(no)) from one forward pass; answers clipped to {jcfg.max_chars} "
            f"characters; a judge's pass = score >= {args.threshold}.", ""]
    body += ["| env | episodes | verifier pass: scripted | verifier pass: policy | verifier-separated pairs | play s |",
             "|---|---|---|---|---|---|"]
    for env_name, (v, play_s) in splits.items():
        body.append(f"| {env_name} | {v['episodes']} | {v['scripted'][1]} / {v['scripted'][0]} | "
                    f"{v['policy'][1]} / {v['policy'][0]} | {v['pairs']} | {play_s:.0f} |")
    body += ["", "| env | judge | mode | groups answered / asked | separated pairs judged | pairwise agreement | "
             "ties | episodes scored | accuracy | Cohen's kappa | AUROC | groups skipped | judge s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for env_name, judge_name, mode, a, secs in rows:
        body.append(f"| {env_name} | {judge_name} | {mode} | {a['answered']} / {a['groups']} | {a['pairs']} | "
                    f"{_f(a['pairwise'])} | {a['ties']} | {a['scored']} | {_f(a['accuracy'])} | {_f(a['kappa'])} | "
                    f"{_f(a['auroc'])} | {a['skipped']} | {secs:.0f} |")
    body += [""] + [f"- {e}, {j}, {m}: first skip: {a['first_skip'][:200]!r}"
                    for e, j, m, a, _ in rows if a["first_skip"]]
    body += ["", "Figures are over the episodes each mode scored (ranking and rubric: a malformed JSON reply twice "
                 "skips the group, as `flywheel traces judge` does; verdict reads token probabilities and skips "
                 "only when no yes or no token has any). nan: nothing to measure. The scripted solver's answers "
                 "are templated: a judge may separate them by style, so agreement here is an upper bound on "
                 "separating right from wrong. A 135M judge is a floor, not a usable judge."]
    keys = {"ranking": ("answered", "pairwise"), "rubric": ("answered", "kappa"),
            "verdict": ("pairs", "pairwise", "accuracy", "kappa", "auroc")}
    line = " ".join(f"{e}_{m}_{k}={_f(a[k]) if isinstance(a[k], float) else a[k]}"
                    for e, modes in last.items() for m, a in modes.items() for k in keys[m])
    common.append_report("Judge agreement with the verifier (calculator, code_repair)", "\n".join(body),
                         f"judge_agreement: {line} judge={judges[0][0]}", write=not args.no_report)


if __name__ == "__main__":
    main()
