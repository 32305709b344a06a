"""How far a judge model agrees with an environment's verifier, where both exist.

For each environment (calculator, code_repair) a policy model plays `--n` episodes of each of
`--groups` test tasks (temperature 1, the env's tools); the env's verifier grades each episode
(pass = reward >= 1). The judge then scores the same episodes as flywheel's judge scores traces
(loop/judging.py, in process through SamplerJudge, greedy):
  ranking: each task's episodes side by side (RULER-style). Pairwise agreement = of the pairs of
           one group the verifier separates (one passed, one failed), the share the judge
           orders the same way (a tie counts as not agreeing).
  rubric:  each episode alone; its score >= --threshold is the judge's "pass". Accuracy and
           Cohen's kappa against the verifier's pass/fail.
Groups whose judge reply was malformed twice are skipped (as in production) and counted; the
agreement figures are over the groups the judge answered. Judges: SmolLM2-135M-Instruct (when
`flywheel model fetch smollm2-135m-instruct` has cached it) and the untrained tiny model as a
floor (it never answers in JSON, so every group is skipped). A 135M judge is weak: this measures
how weak, it does not make the judge good.

Tiny run: python bench/judge_agreement.py --groups 2 --n 2 --no-report
Full run: python bench/judge_agreement.py --groups 16 --n 4 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def play_groups(env, tasks, engine, n: int, max_tokens: int):
    """[(task, [(turns after the prompt, verifier passed)] * n)] for each task."""
    from flywheel.envs.model_policy import ModelPolicy
    from flywheel.inference import SamplingParams
    from flywheel.rollout.play import play

    policy = ModelPolicy(engine, SamplingParams(temperature=1.0, max_tokens=max_tokens))
    episodes = asyncio.run(play(env, tasks, policy, group_size=n, timeout_s=600))
    out = []
    for i, task in enumerate(tasks):
        group = episodes[i * n:(i + 1) * n]
        answers = []
        for ep in group:
            if isinstance(ep.transcript, str):
                turns = [{"role": "assistant", "content": ep.transcript[len(task.prompt):]}]
            else:
                turns = list(ep.transcript[len(task.prompt):]) or [{"role": "assistant", "content": ""}]
            answers.append((turns, ep.error is None and ep.reward >= 1.0))
        out.append((task, answers))
    return out


def judge_all(judge, played, jcfg):
    """Ranking results and rubric results over `played` (one group per task; one per episode)."""
    from flywheel.loop.judge import Attempt, group_attempts
    from flywheel.loop.judging import judge_groups

    attempts = [[Attempt(f"{ti}-{k}", task.prompt, turns, seq=ti * 100 + k, tools=task.tools)
                 for k, (turns, _) in enumerate(answers)] for ti, (task, answers) in enumerate(played)]
    ranking_groups, _ = group_attempts(itertools.chain.from_iterable(attempts), jcfg.model_copy(update={"mode": "ranking"}))
    rubric_groups, _ = group_attempts(itertools.chain.from_iterable(attempts), jcfg.model_copy(update={"mode": "rubric"}))
    return judge_groups(judge, ranking_groups, jcfg), judge_groups(judge, rubric_groups, jcfg)


def agreement(played, ranking, rubric, threshold: float) -> dict:
    passed = {f"{ti}-{k}": ok for ti, (_, answers) in enumerate(played) for k, (_, ok) in enumerate(answers)}
    pairs = agree = ties = 0
    for r in ranking:
        if r.answer is None:
            continue
        scored = [(passed[m.id], s) for m, s in zip(r.group.members, r.answer.scores)]
        for (va, sa), (vb, sb) in itertools.combinations(scored, 2):
            if va == vb:
                continue
            pairs += 1
            ties += sa == sb
            agree += (sa > sb) == va and sa != sb
    votes = [(passed[r.group.members[0].id], r.answer.scores[0] >= threshold) for r in rubric if r.answer]
    n = len(votes)
    acc = sum(v == j for v, j in votes) / n if n else math.nan
    pv, pj = (sum(v for v, _ in votes) / n, sum(j for _, j in votes) / n) if n else (math.nan, math.nan)
    pe = pv * pj + (1 - pv) * (1 - pj)
    kappa = (acc - pe) / (1 - pe) if n and pe < 1 else math.nan
    return {"groups": len(ranking), "ranked": sum(r.answer is not None for r in ranking), "pairs": pairs,
            "pairwise": agree / pairs if pairs else math.nan, "ties": ties, "episodes": len(passed),
            "verifier_pass": sum(passed.values()), "rubric_scored": n, "accuracy": acc, "kappa": kappa,
            "skipped": sum(r.answer is None for r in ranking) + sum(r.answer is None for r in rubric),
            "first_skip": next((r.reason for r in [*ranking, *rubric] if r.reason), None)}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=16, help="test tasks per environment (one judge group each)")
    ap.add_argument("--n", type=int, default=4, help="episodes per task")
    ap.add_argument("--envs", default="calculator,code_repair")
    ap.add_argument("--policy", default=None, help="the policy's model folder (default: SmolLM2 when cached, "
                                                   "else the tiny model)")
    ap.add_argument("--max-tokens", type=int, default=96, help="policy tokens per turn")
    ap.add_argument("--threshold", type=float, default=0.5, help="rubric score counted as the judge's pass")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-report", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    from flywheel.envs import load_env
    from flywheel.inference import LocalEngine
    from flywheel.loop.judge_config import JudgeConfig
    from flywheel.loop.judging import SamplerJudge

    judges = _judges(args)
    policy_path = Path(args.policy) if args.policy else judges[0][1]
    policy = LocalEngine.from_path(str(policy_path))
    jcfg = JudgeConfig(max_tokens=96, max_chars=1500)
    rows, last = [], {}  # last: env -> the first judge's figures, for the last line
    for env_name in args.envs.split(","):
        env = load_env(env_name)
        t0 = time.perf_counter()
        played = play_groups(env, env.tasks("test", n=args.groups, seed=args.seed), policy, args.n, args.max_tokens)
        play_s = time.perf_counter() - t0
        for judge_name, path in judges:
            engine = LocalEngine.from_path(str(path))
            t0 = time.perf_counter()
            ranking, rubric = judge_all(SamplerJudge(engine, engine.tokenizer, judge_name), played, jcfg)
            a = agreement(played, ranking, rubric, args.threshold)
            rows.append((env_name, judge_name, a, play_s, time.perf_counter() - t0))
            if judge_name == judges[0][0]:
                last[env_name] = a
    body = [f"Machine: {common.machine_line(threads)}. Policy: {policy_path.name}, temperature 1, "
            f"{args.max_tokens} tokens a turn; {args.groups} test tasks per environment, {args.n} episodes each; "
            f"judge greedy, {jcfg.max_tokens} reply tokens, answers clipped to {jcfg.max_chars} characters; "
            f"rubric pass = score >= {args.threshold}.", "",
            "| env | judge | groups ranked / asked | verifier-separated pairs | pairwise agreement | ties | "
            "episodes (verifier pass) | rubric scored | accuracy | Cohen's kappa | groups skipped | play s | judge s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for env_name, judge_name, a, play_s, judge_s in rows:
        body.append(f"| {env_name} | {judge_name} | {a['ranked']} / {a['groups']} | {a['pairs']} | "
                    f"{a['pairwise']:.2f} | {a['ties']} | {a['episodes']} ({a['verifier_pass']}) | "
                    f"{a['rubric_scored']} | {a['accuracy']:.2f} | {a['kappa']:.2f} | {a['skipped']} | "
                    f"{play_s:.0f} | {judge_s:.0f} |")
    body += [""] + [f"- {e}, {j}: first skip: {a['first_skip'][:200]!r}" for e, j, a, _, _ in rows if a["first_skip"]]
    body += ["", "Agreement is over the groups the judge answered in the asked JSON (a malformed reply twice "
                 "skips the group, as `flywheel traces judge` does); nan: nothing to measure (no pair the "
                 "verifier separates, or no group answered). A 135M judge is a floor, not a usable judge."]
    line = " ".join(f"{e}_{k}={v:.2f}" if isinstance(v, float) else f"{e}_{k}={v}"
                    for e, a in last.items() for k, v in a.items()
                    if k in ("pairwise", "pairs", "kappa", "accuracy", "ranked", "groups"))
    common.append_report("Judge agreement with the verifier (calculator, code_repair)", "\n".join(body),
                         f"judge_agreement: {line} judge={judges[0][0]}", write=not args.no_report)


if __name__ == "__main__":
    main()
