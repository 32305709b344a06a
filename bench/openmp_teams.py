"""Why a process keeps its parallel torch work on one thread (flywheel/threads.py): a decode step
with one OpenMP team in the process against the same step after a second thread made a team.

libgomp keeps a team of worker threads for each thread that ever ran a parallel op; once it
manages more threads than CPUs it cuts its workers' spin-wait to ~100 iterations, and each
parallel op then pays a futex wake-up. The server hit exactly this: the kernels were built on
the main thread and the scheduler thread decoded.

Protocol: SmolLM2-135M-Instruct (`flywheel model fetch`; `--model tiny` for the peer protocol's
tiny Qwen2) on the lean decoder's default kernels, and the eight rank-16 adapters of
bench/lora_serve.py. A decode step of 32 rows at cache length 160: the bare base, and LoRA with
row i on adapter i mod 8. Each arrangement runs in a fresh interpreter whose main thread only
starts a worker thread that decodes:
  one team:  the worker builds the kernels, lays out the adapters and decodes;
  two teams: the main thread builds the kernels and lays out the adapters (what the server did
             before), then the worker decodes.
Per process: `--steps` timed steps of each kind, interleaved, after 3 warm-up steps; its figure
is the median. The two arrangements alternate `--repeats` times; reported: medians of the
processes' figures (range) and the ratio two teams / one team of step times, paired per repeat.

Training beside an idle team (why an idle scheduler's thread ends, inference/scheduler.py): an
SFT step (forward, backward, AdamW) of the peer protocol's tiny model on 16 x 128 tokens, on the
main thread, alone (one team) or with another live thread that ran one parallel op and now
waits (two teams), the same repeats and steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROWS, CACHED, ADAPTERS, RANK = 32, 160, 8, 16

CHILD = r"""
import json, statistics, sys, threading, time
import torch
torch.set_num_threads(int(sys.argv[4]))
from flywheel.inference.decoder import LeanDecoder
from flywheel.inference.lora import Resident, RowGroups, read_adapter
from flywheel.models import load

model_dir, adapters, arrangement, steps = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[5])
ROWS, CACHED = %d, %d
model, _ = load(model_dir)
decoder = LeanDecoder(model)
state = {}

def build():
    layout = decoder.layout()
    residents = [Resident(read_adapter(a), layout, torch.float32, torch.device("cpu")) for a in adapters]
    state["rows"] = [residents[i %% len(residents)] for i in range(ROWS)]
    state["cache"] = decoder.new_cache(ROWS, CACHED + 8)
    state["cache"].kv.normal_()
    step(False)  # builds the kernels on this thread

def step(lora):
    cache = state["cache"]
    cache.length = CACHED
    groups = RowGroups(state["rows"], 1, torch.device("cpu")) if lora else None
    decoder.forward(torch.full((ROWS, 1), 7), torch.full((ROWS, 1), CACHED), cache, None, False, lora=groups)

def decode():
    if arrangement == "one":
        build()
    for lora in (False, True) * 3:
        step(lora)
    times = {False: [], True: []}
    for _ in range(steps):
        for lora in (False, True):
            t = time.perf_counter()
            step(lora)
            times[lora].append(time.perf_counter() - t)
    state["out"] = {"base_ms": 1e3 * statistics.median(times[False]), "lora_ms": 1e3 * statistics.median(times[True])}

if arrangement == "two":
    build()
worker = threading.Thread(target=decode)
worker.start()
worker.join()
print(json.dumps(state["out"]))
""" % (ROWS, CACHED)

TRAIN_CHILD = r"""
import json, statistics, sys, threading, time
import torch
torch.set_num_threads(int(sys.argv[3]))
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, 200, (16, 128), generator=torch.Generator().manual_seed(0))
idle = threading.Event()
if sys.argv[2] == "two":
    def bystander():
        torch.randn(1000, 1000).mul_(2)  # a parallel op: this thread keeps a team while it waits
        idle.wait()
    threading.Thread(target=bystander).start()
    time.sleep(0.2)

def step():
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()

for _ in range(3):
    step()
times = []
for _ in range(int(sys.argv[4])):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
idle.set()
print(json.dumps({"train_ms": 1e3 * statistics.median(times)}))
"""


def run_child(model: Path, adapters: list[Path], arrangement: str, threads: int, steps: int) -> dict:
    decode = _child([CHILD, str(model), json.dumps([str(a) for a in adapters]), arrangement, str(threads),
                     str(steps)], arrangement)
    return {**decode, **_child([TRAIN_CHILD, str(common.tiny_model()), arrangement, str(threads), str(steps)],
                               arrangement)}


def _child(argv: list[str], arrangement: str) -> dict:
    out = subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{arrangement} team(s) child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from lora_serve import make_adapters, model_folder

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=["smollm2-135m-instruct", "tiny"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="tiny model, one short repeat, writes nothing")
    ap.add_argument("--no-write", action="store_true", help="print the table, append nothing")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.repeats, args.steps = "tiny", 1, 3
    model = model_folder(args.model)
    adapters = make_adapters(model, common.WORK / "lora_serve" / args.model, ADAPTERS, RANK)
    runs: dict[str, list[dict]] = {"one": [], "two": []}
    for rep in range(args.repeats):
        for arrangement in (["one", "two"] if rep % 2 == 0 else ["two", "one"]):
            runs[arrangement].append(run_child(model, adapters, arrangement, args.threads, args.steps))
            print(f"repeat {rep} {arrangement} team(s): {runs[arrangement][-1]}", flush=True)

    def rng(values: list[float], digits: int = 1) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    ratios = {k: [t[k] / o[k] for o, t in zip(runs["one"], runs["two"])] for k in ("base_ms", "lora_ms", "train_ms")}
    lines = [f"Machine: {common.machine_line(args.threads)}. Model: {args.model}, lean decoder, default kernels; "
             f"a decode step of {ROWS} rows at cache length {CACHED}; LoRA: row i on adapter i mod {ADAPTERS} "
             f"(rank {RANK}, all seven projections). {args.repeats} processes per arrangement, each the median of "
             f"{args.steps} steps. Figures: median (range) over processes.", "",
             "| arrangement | base step, ms | LoRA step, ms | tiny SFT step, ms |", "|---|---|---|---|",
             *(f"| {name} | {rng([r['base_ms'] for r in runs[key]])} | {rng([r['lora_ms'] for r in runs[key]])} | "
               f"{rng([r['train_ms'] for r in runs[key]])} |"
               for key, name in (("one", "one team: the decoding (training) thread alone"),
                                 ("two", "two teams: the main thread built, another decodes (an idle "
                                         "thread's team beside training)"))), "",
             f"Two teams / one team, step time paired per repeat: base {rng(ratios['base_ms'], 2)}, "
             f"LoRA {rng(ratios['lora_ms'], 2)}, SFT {rng(ratios['train_ms'], 2)}."]
    last = (f"openmp_teams: base_slowdown={statistics.median(ratios['base_ms']):.2f} "
            f"lora_slowdown={statistics.median(ratios['lora_ms']):.2f} "
            f"train_slowdown={statistics.median(ratios['train_ms']):.2f} "
            f"one_team_lora_ms={statistics.median(r['lora_ms'] for r in runs['one']):.1f} "
            f"two_teams_lora_ms={statistics.median(r['lora_ms'] for r in runs['two']):.1f} "
            f"model={args.model} threads={args.threads}")
    common.append_report("bench/openmp_teams.py: one OpenMP team per process, or two",
                         "\n".join(lines), last, write=not (args.smoke or args.no_write))


if __name__ == "__main__":
    main()
