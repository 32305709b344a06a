"""Weight hand-off on the path `flywheel rl` uses: learner publish -> rollout worker pickup ->
first token on the new version, against one plain memcpy of the same bytes, in one run.

The writer is this process, holding the learner's model and the weight segment exactly as
`flywheel rl` makes it (`orchestrate.pool.rollout_transport`: one reader slot per worker,
workers + 2 buffers, fused groups back to back) and publishing through the rollout source
(`ProcessRollouts.publish`). The reader is a real rollout worker process
(orchestrate/worker.py, started by ProcessRollouts), asked for work after each publish with
`min_version` = the new version. Each round times, in rotating order:
  memcpy   the reference: `dst.copy_(src)` for every parameter into preallocated private
           tensors (one copy of the bytes, what moving the weights cannot go below);
  rl step  publish (the learner's copy into a free shared buffer), then the worker's pickup
           (`WorkResult.weight_load_s`: from seeing the newer version until its engine can
           decode, i.e. `LocalEngine.receive`), then the first token on the new version
           (`generate_s` of a one-token episode: prefill, one sampled token, the grading).
ratio = memcpy / (publish + pickup): 1.0 means the hand-off costs no more than one memcpy.
Per-round medians pair measurements taken moments apart (this machine is shared and noisy);
the table quotes the median over rounds and the range.

Rows: the RL path at both sizes (the worker's engine picks its kernels as in a run: packed
oneDNN kernels from hidden 256, so both sizes here are packed: pickup reorders each
projection straight from the leased shared buffer, the one copy those kernels need); the tiny
model and the 100M one with dense kernels forced (what a model below hidden 256 gets: the
engine runs on the shared buffer itself, no copy); and the copy path at both sizes, a segment without reader
slots (`read_into` a private copy, then the reorder), for comparison.

Beside the rows, the other side of the kernel choice: one rollout batch decoded with packed and
with dense kernels (`decode_batch`), so the table shows whether packed kernels repay their
pickup on every version.

Models (fp32): the tiny model of ../shared/peers/trl_grpo_cpu (hidden 256, 4 layers, ffn 1024,
vocab 320), and a ~100M-parameter Qwen2 (hidden 768, 12 layers, 12 heads, 4 kv heads, ffn 2048,
vocab 32768, tied embeddings; random weights, built on the meta device and filled, saved once
under bench-work/ with the tiny model's tokenizer).

Threads: 1 for the writer and for the worker (the worker's setting in asynchronous RL). A copy
is memory-bound: one thread already moves ~10 GB/s here, and on this 2-core machine a second
OpenMP thread mostly adds stragglers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

QWEN2_100M = dict(vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True)


def qwen2_100m():
    """An uninitialised-then-random ~100M Qwen2 on the CPU, without HF's initialisation."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_100M))
    model = model.to_empty(device="cpu").eval()
    model.tie_weights()  # to_empty unties them
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def qwen2_100m_folder() -> Path:
    """qwen2_100m() saved as a model folder (cached) with the tiny model's tokenizer: what a
    rollout worker loads before its first pickup."""
    from flywheel.models import load_tokenizer

    path = common.WORK / "qwen2-100m"
    if not (path / "config.json").exists():
        model = qwen2_100m()
        model.config.eos_token_id = load_tokenizer(common.tiny_model()).eos_token_id
        model.save_pretrained(path)
        load_tokenizer(common.tiny_model()).save_pretrained(path)
    return path


def measure(label: str, folder: Path, rounds: int, calls: int, threads: int, packed: bool | None = None,
            reader_slots: bool = True) -> dict:
    """Medians over rounds of memcpy, publish, pickup and first-token times (s), and ratios."""
    import torch

    from flywheel.envs import load_env
    from flywheel.models import load
    from flywheel.orchestrate.pool import ProcessRollouts, rollout_transport
    from flywheel.orchestrate.worker import WorkerSpec, WorkItem

    model, _ = load(folder)  # the learner's model
    params = dict(model.named_parameters())  # what rl.py publishes (tied weights once)
    private = {k: torch.zeros_like(t) for k, t in params.items()}  # the memcpy target, pages touched
    transport = rollout_transport(model, 1 if reader_slots else 0)
    spec = WorkerSpec(model=str(folder), env_name="arithmetic", env_settings={}, transport_name=transport.name,
                      sampling={"max_tokens": 1, "temperature": 1.0}, group_size=1, threads=threads,
                      packed=packed)
    source = ProcessRollouts(spec, 1, max_restarts=0, log=lambda m: None)
    tasks = load_env("arithmetic").tasks("test", n=16)
    version = -1
    path = "bind" if reader_slots else "copy"

    def memcpy():
        t0 = time.perf_counter()
        with torch.no_grad():
            for k, t in params.items():
                private[k].copy_(t)
        return time.perf_counter() - t0

    def rl_step():
        nonlocal version
        version += 1
        t0 = time.perf_counter()
        source.publish(params, version)
        publish = time.perf_counter() - t0
        source.submit(WorkItem(version, [tasks[version % len(tasks)]], min_version=version))
        results = []
        deadline = time.monotonic() + 600
        while not results and time.monotonic() < deadline:
            results = source.poll(1.0)
        if not results:
            raise RuntimeError(f"{label}: no answer from the rollout worker for version {version}")
        (r,) = results
        if r.version != version or r.weight_pickup != path:
            raise RuntimeError(f"{label}: the worker sampled v{r.version} by {r.weight_pickup!r}, "
                               f"expected v{version} by {path!r}")
        return publish, r.weight_load_s, r.generate_s

    try:
        for _ in range(transport.n_buffers + 1):  # warm-up: the worker starts, every buffer's pages are faulted in
            memcpy()
            rl_step()
        per_round = []
        for rnd in range(rounds):
            got = {"memcpy": [], "rl": []}
            for _ in range(calls):
                for name in (["memcpy", "rl"] if rnd % 2 == 0 else ["rl", "memcpy"]):
                    got[name].append(memcpy() if name == "memcpy" else rl_step())
            per_round.append(dict(memcpy=statistics.median(got["memcpy"]),
                                  publish=statistics.median(p for p, _, _ in got["rl"]),
                                  pickup=statistics.median(p for _, p, _ in got["rl"]),
                                  first=statistics.median(f for _, _, f in got["rl"])))
    finally:
        source.close()
        transport.close()
    for r in per_round:
        r["ratio"] = r["memcpy"] / (r["publish"] + r["pickup"])
    return dict(label=label, params=sum(t.numel() for t in params.values()), tensors=len(params),
                mb=sum(t.numel() * t.element_size() for t in params.values()) / 2**20,
                **{k: [r[k] for r in per_round] for k in ("memcpy", "publish", "pickup", "first", "ratio")})


def decode_batch(folder: Path, packed: bool, repeats: int, episodes: int = 64, tokens: int = 16) -> list[float]:
    """Seconds to decode one rollout batch (`episodes` arithmetic prompts, `tokens` sampled tokens
    each, eos ignored) with the given kernel set, `repeats` times after one warm-up: what a
    worker's kernel choice saves or costs on every version, beside what its pickup costs."""
    from flywheel.envs import load_env
    from flywheel.inference.engine import LocalEngine
    from flywheel.inference.sampler import SamplingParams
    from flywheel.models import load

    model, tokenizer = load(folder)
    engine = LocalEngine(model, tokenizer, version=0, seed=0, packed=packed)
    prompts = [t.prompt for t in load_env("arithmetic").tasks("test", n=episodes)]
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        engine.generate_text(prompts, params)
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, writer and worker (see above)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per row; medians over rounds (9; smoke 2)")
    ap.add_argument("--tiny-calls", type=int, default=None, help="calls of each per round, tiny model (20; smoke 3)")
    ap.add_argument("--big-calls", type=int, default=None, help="calls of each per round, 100M model (3; smoke 1)")
    ap.add_argument("--smoke", action="store_true", help="a quick check that the benchmark runs (not a result)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = common.fill_sizes(ap.parse_args(), smoke=dict(rounds=2, tiny_calls=3, big_calls=1),
                             full=dict(rounds=9, tiny_calls=20, big_calls=3))
    threads = common.set_threads(args.threads)
    tiny, big = common.tiny_model(), qwen2_100m_folder()
    m = dict(rounds=args.rounds, threads=threads)
    results = [measure("tiny (hidden 256, 4 layers), RL path: packed", tiny, calls=args.tiny_calls, **m),
               measure("Qwen2 ~100M (hidden 768, 12 layers), RL path: packed", big, calls=args.big_calls, **m),
               measure("tiny, dense kernels forced (models below hidden 256)", tiny, calls=args.tiny_calls,
                       packed=False, **m),
               measure("Qwen2 ~100M, dense kernels forced", big, calls=args.big_calls, packed=False, **m),
               measure("tiny, copy path (no reader slot)", tiny, calls=args.tiny_calls, reader_slots=False, **m),
               measure("Qwen2 ~100M, copy path (no reader slot)", big, calls=args.big_calls, reader_slots=False, **m)]
    tiny_r, big_r, dense_r, dense_big, copy_tiny, copy_big = results
    decode = {(size, packed): decode_batch(folder, packed, args.rounds)
              for size, folder in (("tiny", tiny), ("100m", big)) for packed in (True, False)}

    def ms(values):
        return common.median_range([v * 1e3 for v in values])

    lines = [
        f"Machine: {common.machine_line(threads)} (writer and worker). fp32; {args.rounds} rounds (order "
        f"alternated), {args.tiny_calls} / {args.big_calls} calls of each per round (tiny / 100M); median over "
        "rounds of per-round medians (range, n = rounds). Segment as `flywheel rl` makes it with one worker: "
        "1 reader slot, 3 buffers. ratio = memcpy / (publish + pickup); the last line's `ratio` is the lower "
        "of the two RL-path rows.", "",
        "| path | params | MB | memcpy (ms) | publish (ms) | pickup (ms) | first token (ms) | **ratio** |",
        "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['label']} | {r['params'] / 1e6:.1f}M ({r['tensors']} tensors) | {r['mb']:.0f} "
                     f"| {ms(r['memcpy'])} | {ms(r['publish'])} | {ms(r['pickup'])} | {ms(r['first'])} "
                     f"| **{common.median_range(r['ratio'])}** |")
    lines += ["", "Pickup with packed kernels: oneDNN's reorder of every projection into its blocked layout, read "
              "straight from the leased buffer, the one copy they need (embeddings, norms and biases stay views of "
              "the buffer). With dense kernels the parameters become views of the leased buffer: no copy. The copy "
              "path adds a `read_into` of everything before the reorder."]

    lines += ["", f"What the kernel choice buys on every version: one rollout batch (64 arithmetic prompts, 16 "
              f"sampled tokens each, eos ignored) decoded by one engine, {args.rounds} repeats after a warm-up, "
              "median (range); beside it the extra pickup of packed kernels (packed pickup - dense pickup, "
              "medians of the rows above).", "",
              "| model | decode, packed (ms) | decode, dense (ms) | saved per batch by packed (ms) "
              "| extra pickup of packed (ms) |", "|---|---|---|---|---|"]
    for size, label, pk, dn in (("tiny", "tiny", tiny_r, dense_r), ("100m", "Qwen2 ~100M", big_r, dense_big)):
        saved = statistics.median(decode[size, False]) - statistics.median(decode[size, True])
        extra = statistics.median(pk["pickup"]) - statistics.median(dn["pickup"])
        lines.append(f"| {label} | {ms(decode[size, True])} | {ms(decode[size, False])} | {saved * 1e3:.0f} "
                     f"| {extra * 1e3:.0f} |")

    def med(r, k):
        return statistics.median(r[k])

    last = (f"weights: ratio={min(med(tiny_r, 'ratio'), med(big_r, 'ratio')):.2f} path=rl "
            f"tiny_ratio={med(tiny_r, 'ratio'):.2f} ratio_100m={med(big_r, 'ratio'):.2f} "
            f"dense_tiny_ratio={med(dense_r, 'ratio'):.2f} dense_ratio_100m={med(dense_big, 'ratio'):.2f} "
            f"copy_tiny_ratio={med(copy_tiny, 'ratio'):.2f} "
            f"copy_ratio_100m={med(copy_big, 'ratio'):.2f} memcpy_ms_100m={med(big_r, 'memcpy') * 1e3:.1f} "
            f"publish_ms_100m={med(big_r, 'publish') * 1e3:.1f} pickup_ms_100m={med(big_r, 'pickup') * 1e3:.1f} "
            f"first_token_ms_100m={med(big_r, 'first') * 1e3:.1f} "
            f"decode_ms_100m_packed={statistics.median(decode['100m', True]) * 1e3:.0f} "
            f"decode_ms_100m_dense={statistics.median(decode['100m', False]) * 1e3:.0f} threads={threads}"
            + (" smoke=1" if args.smoke else ""))
    common.append_report("bench/weights.py: publish -> worker pickup -> first token, the RL path, vs one memcpy",
                         "\n".join(lines), last, write=not args.no_write)


if __name__ == "__main__":
    main()
