"""Shared-memory weight hand-off (publish + pickup) vs one plain memcpy of the same bytes, same run.

For each model, every round times, in rotating order:
  memcpy     the reference: `dst.copy_(src)` for every parameter into preallocated private
             tensors (one copy of the bytes, what moving the weights cannot go below);
  zero-copy  `SharedMemoryTransport.publish` (one copy into a free shared buffer) then
             `reader.bind(model)` on a second model (its parameters now point at the leased
             buffer: no copy);
  copy-mode  `publish` then `read_into(model parameters)`, the older path (two copies).
ratio = memcpy time / (publish + pickup time): 1.0 means the hand-off costs no more than one
memcpy. Per-round ratios pair the measurements taken moments apart (this machine is shared and
noisy); the table quotes medians over rounds. Writer and reader sit in one process here
(separate attachments of the segment, as in two processes), so the pickup runs with caches the
writer's copy has just flushed: a conservative figure. Where the model is small enough for the
cache (tiny: 16 MB against a 32 MB L3), memcpy rewrites one warm destination while publish
alternates between buffers, which costs it a little.

Models (fp32): the tiny model of ../shared/peers/trl_grpo_cpu (hidden 256, 4 layers, ffn 1024,
vocab 320), and a ~100M-parameter Qwen2 (hidden 768, 12 layers, 12 heads, 4 kv heads, ffn 2048,
vocab 32768, tied embeddings) built on the meta device and materialised uninitialised then
filled, so no Hugging Face initialisation runs.

Threads: 1 by default. A copy is memory-bound: one thread already moves ~10 GB/s here, about what
two do, and on this 2-core machine, shared with other work, a second OpenMP thread mostly adds
stragglers (per-tensor copies of the 100M model swung 80-440 ms with 2 threads, 88-109 ms with 1).
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


def tiny():
    from flywheel.models import load

    return load(common.tiny_model())[0]


def measure(label: str, make_model, rounds: int, calls: int) -> dict:
    """Median times (s) of memcpy, publish, bind, read_into over rounds, and per-round ratios."""
    import torch

    from flywheel.weights.shm import SharedMemoryTransport

    src_model, dst_model = make_model(), make_model()
    state = {k: p.detach() for k, p in src_model.named_parameters()}  # (unique tensors: ties once)
    private = {k: torch.zeros_like(t) for k, t in state.items()}  # the memcpy target, pages touched
    copy_dest = {k: p.detach() for k, p in make_model().named_parameters()}  # read_into target
    writer = SharedMemoryTransport.create(state, readers=1)  # 3 buffers: the writer never waits
    rt = SharedMemoryTransport.attach(writer.name)
    reader = rt.reader()
    version = 0

    def memcpy():
        t0 = time.perf_counter()
        with torch.no_grad():
            for k, t in state.items():
                private[k].copy_(t)
        return time.perf_counter() - t0, 0.0

    def publish() -> float:
        nonlocal version
        version += 1
        t0 = time.perf_counter()
        writer.publish(state, version)
        return time.perf_counter() - t0

    def zero_copy():
        tp = publish()
        t0 = time.perf_counter()
        assert reader.bind(dst_model) == version
        return tp, time.perf_counter() - t0

    def copy_mode():
        tp = publish()
        t0 = time.perf_counter()
        assert rt.read_into(copy_dest) == version
        return tp, time.perf_counter() - t0

    ops = {"memcpy": memcpy, "zero-copy": zero_copy, "copy-mode": copy_mode}
    for _ in range(2):  # warm-up: every shared buffer's pages are faulted in
        for op in ops.values():
            op()
    rounds_out = []
    for rnd in range(rounds):
        names = list(ops)[rnd % 3:] + list(ops)[:rnd % 3]
        got = {n: [] for n in ops}
        for _ in range(calls):
            for n in names:
                got[n].append(ops[n]())
        med = {n: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for n, v in got.items()}
        rounds_out.append(med)
    torch.testing.assert_close(dict(dst_model.named_parameters())["model.norm.weight"], state["model.norm.weight"])
    reader.close()
    rt.close()
    writer.close()

    def mid(f):
        return statistics.median(f(r) for r in rounds_out)

    return dict(
        label=label, params=sum(t.numel() for t in state.values()), tensors=len(state),
        mb=sum(t.numel() * t.element_size() for t in state.values()) / 2**20,
        memcpy=mid(lambda r: r["memcpy"][0]),
        zc_publish=mid(lambda r: r["zero-copy"][0]), zc_pickup=mid(lambda r: r["zero-copy"][1]),
        cm_publish=mid(lambda r: r["copy-mode"][0]), cm_pickup=mid(lambda r: r["copy-mode"][1]),
        ratio=mid(lambda r: r["memcpy"][0] / sum(r["zero-copy"])),
        cm_ratio=mid(lambda r: r["memcpy"][0] / sum(r["copy-mode"])),
        ratios=[r["memcpy"][0] / sum(r["zero-copy"]) for r in rounds_out])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (copies are memory-bound, see above)")
    ap.add_argument("--rounds", type=int, default=9,
                    help="rounds of (memcpy, zero-copy, copy-mode); medians over rounds")
    ap.add_argument("--tiny-calls", type=int, default=20, help="calls of each per round, tiny model")
    ap.add_argument("--big-calls", type=int, default=3, help="calls of each per round, 100M model")
    ap.add_argument("--no-report", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)

    results = [measure("tiny (hidden 256, 4 layers)", tiny, args.rounds, args.tiny_calls),
               measure("Qwen2 ~100M (hidden 768, 12 layers)", qwen2_100m, args.rounds, args.big_calls)]
    ms = 1e3
    lines = [
        f"Machine: {common.machine_line(threads)}. fp32 parameters; {args.rounds} rounds (order rotated), "
        f"{args.tiny_calls} / {args.big_calls} calls of each per round (tiny / 100M); medians of per-round "
        "medians. Segment: 1 reader slot, 3 buffers. ratio = memcpy / (publish + pickup); the last line's "
        "`ratio` is the lower of the two models'.", "",
        "| model | params | MB | memcpy | publish | pickup: bind (zero-copy) | **ratio** "
        "| pickup: read_into | ratio, copy-mode |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['label']} | {r['params'] / 1e6:.1f}M ({r['tensors']} tensors) | {r['mb']:.0f} "
            f"| {r['memcpy'] * ms:.2f} ms | {r['zc_publish'] * ms:.2f} ms | {r['zc_pickup'] * 1e6:.0f} us "
            f"| **{r['ratio']:.2f}** "
            f"| {r['cm_pickup'] * ms:.2f} ms | {r['cm_ratio']:.2f} |")
    lines += ["", "Per-round ratios (zero-copy): " + "; ".join(
        f"{r['label'].split(' (')[0]}: {', '.join(f'{x:.2f}' for x in r['ratios'])}" for r in results)]
    tiny_r, big_r = results
    last = (f"weights: ratio={min(tiny_r['ratio'], big_r['ratio']):.2f} tiny_ratio={tiny_r['ratio']:.2f} "
            f"ratio_100m={big_r['ratio']:.2f} copy_mode_ratio_100m={big_r['cm_ratio']:.2f} "
            f"pickup_us_100m={big_r['zc_pickup'] * 1e6:.0f} memcpy_ms_100m={big_r['memcpy'] * ms:.1f} "
            f"threads={threads}")
    common.append_report("bench/weights.py: shared-memory publish + pickup vs one memcpy", "\n".join(lines),
                         last, write=not args.no_report)


if __name__ == "__main__":
    main()
