"""LocalEngine vs Hugging Face `model.generate` (sampling), useful tokens/s, same run.

Shapes (model of ../shared/peers/trl_grpo_cpu after a short SFT warm start, fp32):
  grpo: 8 prompts x n=8 samples, <= 6 new tokens, rows stop at eos (a GRPO step's rollouts)
  b64:  64 distinct prompts x 16 new tokens, no early stop
Useful tokens: each row's tokens up to and including its stop. The arithmetic floor is the
time the matmuls of that work alone take at the matmul rate measured here, now.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def useful_hf(out_ids, prompt_len: int, eos_ids: set[int]) -> list[int]:
    lens = []
    for row in out_ids[:, prompt_len:].tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        lens.append(n)
    return lens


def matmul_flops_per_token(model) -> int:
    import torch

    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 2 * linear  # lm_head is a Linear (tied or not)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--calls", type=int, default=5, help="generate calls per repeat and system")
    ap.add_argument("--sft-steps", type=int, default=200)
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    import torch

    from flywheel.envs.arithmetic import prompt_of, split_pairs
    from flywheel.inference import LocalEngine, SamplingParams
    from flywheel.models import load

    path = common.warm_model(args.sft_steps)
    engine = LocalEngine.from_path(str(path), seed=0)
    hf, tok = load(path)
    eos = sorted(engine.eos_ids)
    flops_tok = matmul_flops_per_token(hf)
    rng = random.Random(0)
    train, _ = split_pairs()

    def shape_prompts(k):
        return [prompt_of(*rng.choice(train)) for _ in range(k)]

    shapes = {
        "grpo": dict(n_prompts=8, n=8, max_new=6, stop_at_eos=True),
        "b64": dict(n_prompts=64, n=1, max_new=16, stop_at_eos=False),
    }
    results = {}
    for name, s in shapes.items():
        ours_t, hf_t, ours_tok, hf_tok, work = [], [], [], [], []
        for rep in range(args.repeats + 1):  # the first round warms up and is dropped
            # one repeat = `--calls` generate calls on fresh prompts, by each system in turn
            batches = [shape_prompts(s["n_prompts"]) for _ in range(args.calls)]
            params = SamplingParams(n=s["n"], max_tokens=s["max_new"], ignore_eos=not s["stop_at_eos"])
            kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=s["max_new"],
                      num_return_sequences=s["n"], pad_token_id=tok.pad_token_id, eos_token_id=eos)
            if not s["stop_at_eos"]:
                kw["min_new_tokens"] = s["max_new"]
            id_batches = [[engine.encode(t) for t in texts] for texts in batches]
            t0 = time.perf_counter()
            outs = [engine.generate(ids, params) for ids in id_batches]
            dt = time.perf_counter() - t0
            lens = [len(x.token_ids) for out in outs for g in out for x in g]
            encs = [tok(texts, return_tensors="pt", padding=True, add_special_tokens=False) for texts in batches]
            t1 = time.perf_counter()
            with torch.inference_mode():
                gens = [hf.generate(**enc, **kw) for enc in encs]
            dt_hf = time.perf_counter() - t1
            hf_lens = [n for gen, enc in zip(gens, encs) for n in (
                useful_hf(gen, enc["input_ids"].shape[1], set(eos)) if s["stop_at_eos"] else [s["max_new"]] * gen.shape[0])]
            if rep == 0:
                continue
            ours_t.append(dt), hf_t.append(dt_hf), ours_tok.append(sum(lens)), hf_tok.append(sum(hf_lens))
            # matmul work of our calls: distinct prompt tokens once, then every fed-back token
            work.append(sum(len(i) for ids in id_batches for i in set(map(tuple, ids))) + sum(n - 1 for n in lens))
        ours_rate = [a / b for a, b in zip(ours_tok, ours_t)]
        hf_rate = [a / b for a, b in zip(hf_tok, hf_t)]
        results[name] = dict(
            ours=statistics.median(ours_rate), hf=statistics.median(hf_rate),
            # each repeat runs both on the same prompts back to back: the median of the paired
            # ratios is robust to the machine's drift between repeats
            ratio=statistics.median(o / h for o, h in zip(ours_rate, hf_rate)),
            ratios=[o / h for o, h in zip(ours_rate, hf_rate)],
            ours_ms=1e3 * statistics.median(ours_t), hf_ms=1e3 * statistics.median(hf_t),
            useful_per_row=statistics.median(ours_tok) / (s["n_prompts"] * s["n"] * args.calls),
            flops=statistics.median(work) * flops_tok, useful=statistics.median(ours_tok))
    rate = common.matmul_rate(threads)
    lines = [f"Machine: {common.machine_line(threads)}; matmul rate measured now: {rate / 1e9:.0f} GFLOP/s "
             f"(1024^3 fp32); model: {os.path.relpath(path, common.ROOT)} ({flops_tok // 2 / 1e6:.2f}M matmul params); "
             f"{args.repeats} repeats per shape of {args.calls} calls by each system on the same prompts, "
             f"medians.", "",
             "| shape | LocalEngine useful tok/s | HF generate useful tok/s | ratio (median of paired) | "
             "ratio range | floor tok/s | engine / floor | HF / floor | useful tokens per row |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        floor_tps = r["useful"] / (r["flops"] / rate)
        lines.append(f"| {name} | {r['ours']:,.0f} | {r['hf']:,.0f} | {r['ratio']:.2f}x | "
                     f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f} | {floor_tps:,.0f} | "
                     f"{r['ours'] / floor_tps:.2f} | {r['hf'] / floor_tps:.2f} | {r['useful_per_row']:.2f} |")
    lines.append("")
    lines.append("grpo = 8 prompts x n=8, <= 6 new tokens, stop at eos; b64 = 64 distinct prompts x 16 new tokens. "
                 "Sampling at temperature 1, no top-k/top-p, on both sides.")
    g, b = results["grpo"], results["b64"]
    last = (f"generate: ratio={g['ratio']:.2f} ratio_b64={b['ratio']:.2f} "
            f"engine_grpo_tok_s={g['ours']:.0f} hf_grpo_tok_s={g['hf']:.0f} engine_b64_tok_s={b['ours']:.0f} "
            f"hf_b64_tok_s={b['hf']:.0f} threads={threads}")
    common.append_report("bench/generate.py: LocalEngine vs HF generate", "\n".join(lines), last)


if __name__ == "__main__":
    main()
