"""Many LoRA fine-tunes served side by side from one base: 32 concurrent clients spread over 8
adapters vs the same clients on the bare base, tokens/s, same run.

Protocol. One OpenAIService over the peer protocol's tiny model (Qwen2, hidden 256, 4 layers,
random weights) on the lean decoder's dense kernels, the kernels LoRA rows run on. Eight
rank-16 adapters on all seven projections (peft, random A and B, so every delta is computed)
are registered with its engine's AdapterPool; each is served through a view of the service
(`OpenAIService.with_adapter`), exactly as the fine-tuning API serves a LoRA job's model. The
load is C asyncio clients calling the service's chat endpoint in process (the HTTP layer,
the same for both phases, is left out: it would only dilute the difference), each taking the
next of N distinct chat requests (`max_tokens` M, temperature 1, no seed) as soon as it is
free. Phases of a round:

  base: every request to the base model;
  lora: request i to adapter i mod 8, so every batch mixes adapters;
  base_packed (context): the base on its own best kernels (packed oneDNN, no LoRA rows).

Round 0 warms up and is dropped; the order of base and lora alternates between rounds.
Generated tokens are counted from `usage.completion_tokens`. Reported: medians over rounds of
tokens/s per phase, and the ratio lora / base as the median of the per-round paired ratios
(range); memory per resident adapter from the pool's tensors.

Smoke run (prints, appends nothing): `python bench/lora_serve.py --smoke`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from serve import request_bodies  # noqa: E402

ADAPTERS = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: Path, root: Path, n: int, rank: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = []
    for i in range(n):
        folder = root / f"adapter{i}-r{rank}"  # a cached adapter of another rank is not this one
        if not (folder / "adapter_model.safetensors").exists():
            torch.manual_seed(i)
            base = AutoModelForCausalLM.from_pretrained(model)
            base.name_or_path = str(model.resolve())
            cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
            get_peft_model(base, cfg).save_pretrained(folder)
        folders.append(folder)
    return folders


async def phase(services: list, bodies: list[dict], clients: int) -> dict:
    """Send every body once from `clients` workers; request i goes to services[i % len]."""
    tokens = [0] * len(bodies)
    next_index = iter(range(len(bodies)))

    async def worker() -> None:
        for i in next_index:
            svc = services[i % len(services)]
            response, _ = await svc.chat({**bodies[i], "model": svc.name})
            tokens[i] = response["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    return dict(tok_s=sum(tokens) / wall, tokens=sum(tokens), wall=wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256, help="per phase")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a short run that writes nothing")
    ap.add_argument("--no-write", action="store_true", help="print the table, append nothing")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.rounds, args.max_tokens = 32, 1, 8
    common.set_threads(args.threads)

    from flywheel.inference import LocalEngine
    from flywheel.serve.core import OpenAIService

    model = common.tiny_model()
    folders = make_adapters(model, common.WORK / "lora_serve", ADAPTERS, args.rank)
    dense = OpenAIService(LocalEngine.from_path(str(model), packed=False), name="tiny",
                          default_max_tokens=args.max_tokens)
    packed = OpenAIService(LocalEngine.from_path(str(model)), name="tiny", default_max_tokens=args.max_tokens)
    pool = dense.engine.adapters
    pool.max_resident = ADAPTERS
    views = []
    for i, folder in enumerate(folders):
        pool.register(f"a{i}", folder)
        views.append(dense.with_adapter(f"ft:tiny:a{i}", f"a{i}"))
    bodies = request_bodies(args.requests, args.max_tokens, 1.0, 12)
    runs: dict[str, list[dict]] = {"base": [], "lora": [], "base_packed": []}

    async def rounds() -> None:
        for rnd in range(args.rounds + 1):
            order = ["base", "lora"] if rnd % 2 == 0 else ["lora", "base"]
            for name in [*order, "base_packed"]:
                services = {"base": [dense], "lora": views, "base_packed": [packed]}[name]
                result = await phase(services, bodies, args.clients)
                if rnd > 0:
                    runs[name].append(result)
                print(f"round {rnd} {name}: {result['tok_s']:.0f} tokens/s ({result['tokens']} tokens)", flush=True)

    asyncio.run(rounds())
    dense.close()
    packed.close()
    ratios = [lo["tok_s"] / b["tok_s"] for lo, b in zip(runs["lora"], runs["base"])]

    def med(name: str) -> float:
        return statistics.median(r["tok_s"] for r in runs[name])

    def rng(values: list[float], digits: int = 0) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    mem_mb = pool.resident_bytes / len(pool.resident) / 2 ** 20
    lines = [f"Machine: {common.machine_line(args.threads)}. Tiny Qwen2 (hidden 256, 4 layers); {ADAPTERS} adapters "
             f"of rank {args.rank} on all seven projections; {args.clients} concurrent clients in process, "
             f"{args.requests} chat requests a phase, max_tokens {args.max_tokens}, temperature 1; "
             f"{args.rounds} rounds after a warm-up. Figures: median of rounds (range).", "",
             "| phase | tokens/s |", "|---|---|",
             f"| base (dense kernels) | {rng([r['tok_s'] for r in runs['base']])} |",
             f"| lora: request i to adapter i mod {ADAPTERS} | {rng([r['tok_s'] for r in runs['lora']])} |",
             f"| base on packed kernels (context) | {rng([r['tok_s'] for r in runs['base_packed']])} |", "",
             f"lora / base, paired per round: {rng(ratios, 2)}; lora / packed base: "
             f"{med('lora') / med('base_packed'):.2f}. Memory per resident adapter: {mem_mb:.2f} MB."]
    last = (f"lora_serve: ratio={statistics.median(ratios):.2f} adapters={ADAPTERS} mem_mb_per_adapter={mem_mb:.2f} "
            f"base_tok_s={med('base'):.0f} lora_tok_s={med('lora'):.0f} packed_base_tok_s={med('base_packed'):.0f} "
            f"clients={args.clients} rank={args.rank}")
    common.append_report("bench/lora_serve.py: 8 LoRA adapters served side by side vs the bare base",
                         "\n".join(lines), last, write=not (args.smoke or args.no_write))


if __name__ == "__main__":
    main()
