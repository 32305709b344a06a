"""How far a judge model agrees with an environment's verifier, where both exist.

For each environment (calculator, code_repair), each of `--groups` test tasks gets groups of
`--n` episodes, n // 2 of them from the environment's scripted solver (env.scripted_policy():
calculator's ScriptedCalculatorPolicy, code_repair's GoldPatchPolicy, which the verifier
passes), the rest failing ones, of two kinds (`--groups-kind matched|mixed|both`):
  matched: the same scripted solver made wrong, played through the env so the verifier grades
           it, and nothing else changed: calculator's WrongAnswerPolicy states the tool's result
           plus a small nonzero seeded offset; code_repair's WrongPatchPolicy submits the gold
           patch with one token of its fix changed (a near miss: another constant or operator,
           `not` added or dropped; when the fix line has none but the bug's own, the fix is left
           out and one token of a context line changed; when that has none either, about one
           bundled instance in seven, the edit rewrites the buggy lines unchanged), as the same
           str_replace calls. Right and wrong answers read alike, so only correctness
           separates them. This is the measurement.
  mixed:   a policy model (temperature 1, the env's tools; a small one mostly fails). Its
           answers differ from the scripted solver's templated ones in style as well as
           correctness, so a judge may separate them by style alone: in a run of 8 groups of 4,
           the UNTRAINED tiny model as verdict judge had AUROC 0.98 (calculator) / 0.67
           (code_repair), above SmolLM2-135M's 0.76 / 0.50 (docs/benchmarks.md, 2026-12-06).
           Kept, labelled "style differs", so the confound stays visible.
Both kinds share the scripted episodes. A group's members are shuffled with a fixed seed
(`--seed`), so an answer's position does not tell its source (RULER-style judges are
position-biased). The env's verifier grades each episode (pass = reward >= 1); the table shows
its passes by source (scripted: all; wrong and policy: none expected) and warns otherwise. The
judge then scores the same episodes as flywheel's judge scores traces (loop/judging.py, in
process through SamplerJudge):
  ranking: each task's episodes side by side (RULER-style), greedy JSON reply.
  rubric:  each episode alone, greedy JSON reply.
  verdict: each episode alone, asked "Does the answer correctly and fully solve the task?
           Answer yes or no."; score = P(yes) / (P(yes) + P(no)) from one forward pass: no
           text, so no malformed reply (judges too small to write JSON).
Per groups kind and mode, over the episodes it scored: pairwise agreement = of the pairs of one
task's episodes the verifier separates (one passed, one failed), the share the judge orders the
same way (a tie counts as not agreeing); accuracy and Cohen's kappa of score >= --threshold
against the verifier's pass/fail; AUROC of the score against the verifier's pass (no threshold;
pooled over tasks; ties count half). Ranking scores are relative to their group, so its
thresholded figures are shown but mean less. Groups whose JSON reply was malformed twice are
skipped (as in production) and counted. Judges: SmolLM2-135M-Instruct (when `flywheel model
fetch smollm2-135m-instruct` has cached it) and the untrained tiny model as a floor. The last
line holds the matched groups' figures (keys `<env>_matched_<mode>_...`; the mixed groups'
only when `--groups-kind mixed`).

Tiny run: python bench/judge_agreement.py --groups 2 --n 2 --no-report
Full run: python bench/judge_agreement.py --groups 16 --n 4 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import math
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from flywheel.envs.base import Policy  # noqa: E402


MODES = ("ranking", "rubric", "verdict")


def _turns(task, ep) -> tuple[list[dict], bool]:
    if isinstance(ep.transcript, str):
        turns = [{"role": "assistant", "content": ep.transcript[len(task.prompt):]}]
    else:
        turns = list(ep.transcript[len(task.prompt):]) or [{"role": "assistant", "content": ""}]
    return turns, ep.error is None and ep.reward >= 1.0


class WrongAnswerPolicy(Policy):
    """calculator's matched wrong answer: `inner` (ScriptedCalculatorPolicy) unchanged, but the
    last integer of its final answer (a turn with no tool call) moved by a nonzero offset in
    [-9, 9], seeded by the task and the episode."""

    def __init__(self, inner: Policy, seed: int):
        self.inner, self.seed = inner, seed

    async def act(self, task, history, tools, episode: int = 0) -> str:
        text = await self.inner.act(task, history, tools, episode)
        last = None if "<tool_call>" in text else next(reversed(list(re.finditer(r"-?\d+", text))), None)
        if last is None:
            return text
        offset = random.Random(f"{self.seed}/{task.id}/{episode}").choice([*range(-9, 0), *range(1, 10)])
        return text[:last.start()] + str(int(last.group()) + offset) + text[last.end():]

    async def end_episode(self, episode: int) -> None:
        await self.inner.end_episode(episode)


# one token a near-miss fix changes: an integer, a spaced operator, and/or, True/False, `not `, `if `
_TOKEN = re.compile(r"(?<![\w.])\d+(?![\w.])|(?<= )(?:==|!=|<=|>=|<|>|\+|-|\*|//|%)(?= )"
                    r"|\b(?:and|or|True|False)\b|\bnot (?=[\w(])|\bif (?!not\b)")
_SWAP = {"==": "!=", "!=": "==", "<=": "<", ">=": ">", "<": "<=", ">": ">=", "+": "-", "-": "+", "*": "+",
         "//": "%", "%": "//", "and": "or", "or": "and", "True": "False", "False": "True", "not ": "", "if ": "if not "}


def _variants(line: str, rng: random.Random) -> list[str]:
    """`line` with one token changed, for each changeable token outside strings and comments."""
    code = line.split("#")[0]
    out = []
    for m in _TOKEN.finditer(code):
        if code[:m.start()].count('"') % 2 or code[:m.start()].count("'") % 2:
            continue  # inside a string literal
        tok = m.group()
        if tok.isdigit():
            up = tok == "0" or code[:m.start()].endswith("-")  # never below 0, nor 0 after a minus sign
            new = str(int(tok) + (1 if up else rng.choice((1, -1))))
        else:
            new = _SWAP[tok]
        out.append(line[:m.start()] + new + line[m.end():])
    return out


def _render(files) -> str:
    """Unified diff text of parsed file patches (envs/patches.py FilePatch)."""
    out = []
    for fp in files:
        out += [f"--- {'a/' + fp.old if fp.old else '/dev/null'}\n", f"+++ {'b/' + fp.new if fp.new else '/dev/null'}\n"]
        shift = 0
        for start, _, body in fp.hunks:
            n_old, n_new = sum(t != "+" for t, _ in body), sum(t != "-" for t, _ in body)
            out.append(f"@@ -{start},{n_old} +{start + shift},{n_new} @@\n")
            out += [tag + (line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
                    for tag, line in body]
            shift += n_new - n_old
    return "".join(out)


def wrong_patch(patch: str, rng: random.Random) -> str:
    """A plausible wrong fix in the gold patch's format: its first hunk with a changed line gets a
    near miss (one of its added lines with one token changed, never back to a removed line), else
    (no such token) the fix is left out and one token of a context line changed instead, else the
    hunk's old text is kept unchanged. The other hunks stay as they are."""
    from flywheel.envs.patches import parse_patch

    files = parse_patch(patch)
    for fp in files:
        for h, (start, n, body) in enumerate(fp.hunks):
            if fp.old is None or fp.new is None or not any(t != " " for t, _ in body):
                continue
            removed = {line for t, line in body if t == "-"}
            near = [(i, v) for i, (t, line) in enumerate(body) if t == "+"
                    for v in _variants(line, rng) if v not in removed]
            if near:
                i, v = rng.choice(near)
                body = body[:i] + [("+", v)] + body[i + 1:]
            else:
                context = [t == " " for t, _ in body if t != "+"]
                body = [(" ", line) for t, line in body if t != "+"]  # the bug stays
                other = [(i, v) for i, (_, line) in enumerate(body) if context[i] for v in _variants(line, rng)]
                if other:
                    i, v = rng.choice(other)
                    body = body[:i] + [("-", body[i][1]), ("+", v)] + body[i + 1:]
            fp.hunks[h] = (start, n, body)
            return _render(files)
    return patch


class WrongPatchPolicy(Policy):
    """code_repair's matched wrong answer: `inner` (GoldPatchPolicy) playing `wrong_patch` of the
    task's gold patch (seeded by the task and the episode) in its place: the same str_replace
    calls and submit, a patch the tests fail."""

    def __init__(self, inner: Policy, seed: int):
        self.inner, self.seed = inner, seed

    async def act(self, task, history, tools, episode: int = 0) -> str:
        wrong = wrong_patch(task.answer, random.Random(f"{self.seed}/{task.id}/{episode}"))
        return await self.inner.act(dataclasses.replace(task, answer=wrong), history, tools, episode)

    async def end_episode(self, episode: int) -> None:
        await self.inner.end_episode(episode)


WRONG = {"calculator": WrongAnswerPolicy, "code_repair": WrongPatchPolicy}
KINDS = ("matched", "mixed")
OTHER = {"matched": "wrong", "mixed": "policy"}  # each groups kind's failing source


def play_sources(env, tasks, engine, n: int, max_tokens: int, seed: int, kinds) -> dict:
    """source -> (episodes in task order, k per task, play seconds): "scripted" (n // 2 per
    task), and n - n // 2 per task of "wrong" (the scripted solver made wrong, WRONG[env]) for
    the matched groups and "policy" (the model) for the mixed ones."""
    from flywheel.rollout.play import play

    scripted_n, other_n = n // 2, n - n // 2
    policies = {"scripted": (env.scripted_policy(), scripted_n)}
    if "matched" in kinds:
        if env.name not in WRONG:
            raise SystemExit(f"{env.name}: no matched wrong-answer policy (known: {', '.join(WRONG)}); "
                             "use --groups-kind mixed")
        policies["wrong"] = (WRONG[env.name](env.scripted_policy(), seed), other_n)
    if "mixed" in kinds:
        from flywheel.envs.model_policy import ModelPolicy
        from flywheel.inference import SamplingParams

        policies["policy"] = (ModelPolicy(engine, SamplingParams(temperature=1.0, max_tokens=max_tokens)), other_n)
    out = {}
    for source, (policy, k) in policies.items():
        t0 = time.perf_counter()
        eps = asyncio.run(play(env, tasks, policy, group_size=k, timeout_s=600)) if k else []
        out[source] = (eps, k, time.perf_counter() - t0)
    return out


def groups_of(tasks, sources: dict, kind: str, seed: int):
    """[(task, [(turns after the prompt, verifier passed, source)] * n)] for each task: the
    scripted episodes and the kind's failing source's, shuffled with `seed`."""
    out = []
    for i, task in enumerate(tasks):
        group = []
        for source in ("scripted", OTHER[kind]):
            eps, k, _ = sources[source]
            group += [(*_turns(task, ep), source) for ep in eps[i * k:(i + 1) * k]]
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
    out: dict[str, list[int]] = {}
    pairs = 0
    for _, answers in played:
        for _, ok, source in answers:
            counts = out.setdefault(source, [0, 0])
            counts[0] += 1
            counts[1] += ok
        p = sum(ok for _, ok, _ in answers)
        pairs += p * (len(answers) - p)
    return {"by_source": {k: tuple(v) for k, v in out.items()}, "pairs": pairs}


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


LABEL = {"matched": "matched (only correctness differs)", "mixed": "mixed (style differs)"}
SOURCE = {"scripted": "scripted solver", "wrong": "scripted solver made wrong", "policy": "policy model"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=16, help="test tasks per environment (one judge group each)")
    ap.add_argument("--n", type=int, default=4, help="episodes per task (>= 2): n // 2 scripted, the rest failing")
    ap.add_argument("--groups-kind", choices=("matched", "mixed", "both"), default="both",
                    help="the failing episodes: the scripted solver made wrong (matched: only correctness "
                         "differs), the policy model's (mixed: style differs too), or both")
    ap.add_argument("--envs", default="calculator,code_repair")
    ap.add_argument("--policy", default=None, help="the policy's model folder (default: SmolLM2 when cached, "
                                                   "else the tiny model)")
    ap.add_argument("--max-tokens", type=int, default=96, help="policy tokens per turn")
    ap.add_argument("--threshold", type=float, default=0.5, help="a score counted as the judge's pass")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="seeds the task choice, each group's order and the "
                                                        "wrong answers")
    ap.add_argument("--modes", default=",".join(MODES), help="judge modes to measure, of " + ", ".join(MODES))
    ap.add_argument("--no-report", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes {args.modes!r}: each of {', '.join(MODES)}")
    if args.n < 2:
        ap.error("--n must be at least 2 (half scripted, half failing)")
    kinds = KINDS if args.groups_kind == "both" else (args.groups_kind,)
    threads = common.set_threads(args.threads)
    from flywheel.envs import load_env
    from flywheel.inference import LocalEngine
    from flywheel.loop.judge_config import JudgeConfig
    from flywheel.loop.judging import SamplerJudge

    judges = _judges(args)
    policy_path = Path(args.policy) if args.policy else judges[0][1]
    policy = LocalEngine.from_path(str(policy_path)) if "mixed" in kinds else None
    engines = {name: policy if policy is not None and Path(path) == policy_path else LocalEngine.from_path(str(path))
               for name, path in judges}  # the policy's engine judges too when it is the same model
    jcfg = JudgeConfig(max_tokens=96, max_chars=1500)
    # rows: agreement; splits: (env, kind) -> (verifier split, play s); last: (env, kind) -> {mode: first judge's}
    rows, splits, last, warnings = [], {}, {}, []
    for env_name in args.envs.split(","):
        env = load_env(env_name)
        tasks = env.tasks("test", n=args.groups, seed=args.seed)
        sources = play_sources(env, tasks, policy, args.n, args.max_tokens, args.seed, kinds)
        for kind in kinds:
            played = groups_of(tasks, sources, kind, args.seed)
            v = verifier_split(played)
            splits[env_name, kind] = (v, sources["scripted"][2] + sources[OTHER[kind]][2])
            for source, (eps, passed) in v["by_source"].items():
                if passed != (eps if source == "scripted" else 0):
                    warnings.append(f"{env_name}, {kind}: the verifier passed {passed} of {eps} {SOURCE[source]} "
                                    f"episodes ({'all' if source == 'scripted' else 'none'} intended)")
            for judge_name, engine in engines.items():
                judge = SamplerJudge(engine, engine.tokenizer, judge_name)
                for mode in modes:
                    t0 = time.perf_counter()
                    results = judge_mode(judge, played, jcfg, mode)
                    secs = time.perf_counter() - t0
                    a = agreement(played, results, args.threshold)
                    rows.append((env_name, kind, judge_name, mode, a, secs))
                    if judge_name == judges[0][0]:
                        last.setdefault((env_name, kind), {})[mode] = a
    for w in warnings:
        print("warning:", w, file=sys.stderr)
    others = {"matched": f"{args.n - args.n // 2} of the same scripted solver made wrong (calculator: its final "
                         "number moved by a seeded nonzero offset in [-9, 9]; code_repair: the gold patch with one "
                         "token of its fix changed, same str_replace calls), played through the env",
              "mixed": f"{args.n - args.n // 2} of the policy {policy_path.name} (temperature 1, {args.max_tokens} "
                       "tokens a turn)"}
    body = [f"Machine: {common.machine_line(threads)}. Each task's group: {args.n // 2} episode(s) of the env's "
            f"scripted solver (ScriptedCalculatorPolicy, GoldPatchPolicy) and, "
            + "; or ".join(f"in {LABEL[k]} groups, {others[k]}" for k in kinds)
            + f"; shuffled with seed {args.seed}; {args.groups} test tasks per environment. Judge: ranking and rubric "
            f"greedy, {jcfg.max_tokens} reply tokens; verdict P(yes) / (P(yes) + P(no)) from one forward pass; "
            f"answers clipped to {jcfg.max_chars} characters; a judge's pass = score >= {args.threshold}.", ""]
    body += ["| env | groups | verifier pass: scripted | failing source | verifier pass: failing source | "
             "verifier-separated pairs | play s |", "|---|---|---|---|---|---|---|"]
    for (env_name, kind), (v, play_s) in splits.items():
        (se, sp), (oe, op) = v["by_source"].get("scripted", (0, 0)), v["by_source"].get(OTHER[kind], (0, 0))
        body.append(f"| {env_name} | {kind} | {sp} / {se} | {SOURCE[OTHER[kind]]} | {op} / {oe} | {v['pairs']} | "
                    f"{play_s:.0f} |")
    body += [""] + [f"- warning: {w}" for w in warnings] + ([""] if warnings else [])
    body += ["| env | groups | judge | mode | groups answered / asked | separated pairs judged | pairwise agreement | "
             "ties | episodes scored | accuracy | Cohen's kappa | AUROC | groups skipped | judge s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for env_name, kind, judge_name, mode, a, secs in rows:
        body.append(f"| {env_name} | {kind} | {judge_name} | {mode} | {a['answered']} / {a['groups']} | {a['pairs']} | "
                    f"{_f(a['pairwise'])} | {a['ties']} | {a['scored']} | {_f(a['accuracy'])} | {_f(a['kappa'])} | "
                    f"{_f(a['auroc'])} | {a['skipped']} | {secs:.0f} |")
    body += [""] + [f"- {e}, {k}, {j}, {m}: first skip: {a['first_skip'][:200]!r}"
                    for e, k, j, m, a, _ in rows if a["first_skip"]]
    body += ["", "Figures are over the episodes each mode scored (ranking and rubric: a malformed JSON reply twice "
                 "skips the group, as `flywheel traces judge` does; verdict reads token probabilities and skips "
                 "only when no yes or no token has any). nan: nothing to measure. Matched groups are the "
                 "measurement: right and wrong answers come from one scripted solver and read alike, so a judge "
                 "separates them only by correctness. Mixed groups set the scripted solver's templated answers "
                 "against the policy model's: style separates them too (on 2026-12-06 the untrained tiny model, as "
                 "verdict judge, reached AUROC 0.98 / 0.67 there, above SmolLM2-135M's 0.76 / 0.50), so they bound "
                 "nothing and are shown to keep that confound visible. The last line holds the matched groups. A "
                 "135M judge is a floor, not a usable judge."]
    keys = {"ranking": ("answered", "pairwise"), "rubric": ("answered", "kappa"),
            "verdict": ("pairs", "pairwise", "accuracy", "kappa", "auroc")}
    shown = "matched" if "matched" in kinds else "mixed"
    line = " ".join(f"{e}_{k}_{m}_{key}={_f(a[key]) if isinstance(a[key], float) else a[key]}"
                    for (e, k), modes_ in last.items() if k == shown for m, a in modes_.items() for key in keys[m])
    common.append_report("Judge agreement with the verifier (calculator, code_repair)", "\n".join(body),
                         f"judge_agreement: {line} judge={judges[0][0]}", write=not args.no_report)


if __name__ == "__main__":
    main()
