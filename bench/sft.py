"""flywheel SFT vs a bare torch forward + backward + AdamW loop, tokens/s, same run.

Both train the tiny model of ../shared/peers/trl_grpo_cpu (fp32) on the same batches of the
`ab+cd=` task (prompt/completion, 128 examples per step, loss on the completion): flywheel
through `run_sft` (data order, collation, masked loss, clipping, schedule, metrics all
included), the reference as the shortest loop that does the same optimisation on
pre-built tensors. Tokens are the non-padding tokens of each batch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def bare_loop(model_dir: Path, batches, lr: float) -> list[float]:
    """tokens/s of each step of a plain loop: HF forward, full-vocabulary cross-entropy on
    the completion tokens, backward, clip, AdamW."""
    import torch
    import torch.nn.functional as F

    from flywheel.models import load

    model, _ = load(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    rates = []
    for ids, attn, labels in batches:
        t0 = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=attn).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rates.append(int(attn.sum()) / (time.perf_counter() - t0))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="rounds of (flywheel, bare), medians over rounds")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per round (the first 3 are warm-up)")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    import torch

    from flywheel.config import SFTConfig, validate
    from flywheel.envs.arithmetic import split_pairs, write_sft_jsonl
    from flywheel.models import load_tokenizer
    from flywheel.rollout.data_order import DataOrder
    from flywheel.train.padding import pad_batch
    from flywheel.train.metrics import read_metrics
    from flywheel.train.sft import run_sft
    from flywheel.train.sft_data import load_sft_examples

    model_dir = common.tiny_model()
    train, _ = split_pairs()
    data = write_sft_jsonl(common.WORK / "arithmetic_train.jsonl", train)
    cfg_dict = dict(model=str(model_dir), data={"train": [str(data)], "format": "prompt_completion"},
                    train={"steps": args.steps, "batch_size": 128, "micro_batch_size": 128, "seed": 0},
                    optim={"lr": 1e-3, "warmup_steps": 0, "weight_decay": 0.01},
                    log={"progress": False}, checkpoint={"every": 0})
    # the same batches for the bare loop: flywheel's own data order and padding
    tok = load_tokenizer(model_dir)
    examples, _ = load_sft_examples([str(data)], tok, validate({**cfg_dict, "output_dir": "x"}, SFTConfig).data)
    order = DataOrder(len(examples), seed=0)
    batches = []
    for _ in range(args.steps):
        chunk = [examples[i] for i in order.take(128)]
        ids, attn, tmask = pad_batch([e.ids for e in chunk], [e.loss_mask for e in chunk], tok.pad_token_id)
        batches.append((ids, attn, torch.where(tmask.bool(), ids, torch.full_like(ids, -100))))

    ours, bare = [], []
    for rnd in range(args.repeats):
        out = common.WORK / "bench-sft-run"
        shutil.rmtree(out, ignore_errors=True)
        run_sft(validate({**cfg_dict, "output_dir": str(out)}, SFTConfig), log=lambda m: None)
        rates = [r["tokens_per_s"] for r in read_metrics(out / "metrics.jsonl") if "tokens_per_s" in r]
        ours.append(statistics.median(rates[3:]))
        bare.append(statistics.median(bare_loop(model_dir, batches, 1e-3)[3:]))
    o, b = statistics.median(ours), statistics.median(bare)
    body = "\n".join([
        f"Machine: {common.machine_line(threads)}. Model: {os.path.relpath(model_dir, common.ROOT)} (hidden 256, 4 layers, fp32). "
        f"Batches of 128 `ab+cd=` examples (~{sum(int(a.sum()) for _, a, _ in batches) // len(batches)} tokens), "
        f"{args.steps} steps per round (first 3 dropped), {args.repeats} rounds; medians.", "",
        "| loop | tokens/s (median of rounds) | per round |", "|---|---|---|",
        f"| flywheel `run_sft` | {o:,.0f} | {', '.join(f'{x:,.0f}' for x in ours)} |",
        f"| bare torch fwd+bwd+AdamW | {b:,.0f} | {', '.join(f'{x:,.0f}' for x in bare)} |"])
    last = f"sft: ratio={o / b:.2f} flywheel_tok_s={o:.0f} bare_tok_s={b:.0f} threads={threads}"
    common.append_report("bench/sft.py: flywheel SFT vs a bare torch loop", body, last)


if __name__ == "__main__":
    main()
