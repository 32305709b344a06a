"""`flywheel serve` under load: N chat requests one at a time vs from 32 concurrent clients, same run.

Protocol. The real server (`flywheel serve`, uvicorn, in a subprocess so the load generator
never shares its GIL) serves the peer protocol's tiny model (Qwen2, hidden 256, 4 layers,
random weights, byte-level tokenizer) on loopback, recording every response as a trace in a
fresh SQLite file, as in production. The load generator is asyncio + httpx.AsyncClient
(keep-alive connections). One list of N distinct chat requests (a short system message and
a user message of 3-12 words, `max_tokens` M, temperature 1, no seed: a seeded request is
batched alone) is sent in two phases:

  sequential: one client, each request sent when the previous answer arrived;
  concurrent: C clients, each taking the next request of the list as soon as it is free.

A round runs both phases (the order alternates between rounds); round 0 warms up and is
dropped. Generated tokens are counted from each response's `usage.completion_tokens`, so a
choice that stops early at eos (the random model emits one now and then) counts what it
really generated; tokens per request are printed per phase to show the work was the same.
Reported: medians over rounds of completion tokens/s, requests/s and per-request latency
p50 / p99 (wall time of the HTTP call, client side) per phase, and the ratio concurrent /
sequential tokens/s as the median of the per-round paired ratios.

Prompt length matters: the scheduler batches whole requests, and a prompt's prefill gains
little from batching while decoding gains a lot, so the ratio falls as prompt tokens grow
against max_tokens. The tiny model's tokenizer is byte-level (one token per byte, ~4x the
tokens a BPE tokenizer gives the same text); prompt tokens per request are reported.

Smoke run (prints, appends nothing): `python bench/serve.py --smoke`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WORDS = ("agent tool call model weights batch token cache request server trace reward policy "
         "gradient sample prompt answer search file code test deploy metric latency queue").split()


@contextmanager
def flywheel_server(model: Path, workdir: Path, *, threads: int, traces_db: str | None, extra: tuple = ()):
    """`flywheel serve` in a subprocess on a free loopback port; yields its base URL. The
    process is stopped (SIGTERM, then SIGKILL) on the way out, error or not."""
    import httpx

    from flywheel.serve.background import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "flywheel.cli.main", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--threads", str(threads), "--log-level", "warning", *extra]
    cmd += ["--traces-db", traces_db] if traces_db else ["--no-traces"]
    log_path = workdir / f"server-{port}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        log.flush()
        return log_path.read_text(errors="replace")[-3000:]

    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before it answered:\n{tail()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server on {url} did not answer /health in 180 s:\n{tail()}")
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()
        if proc.returncode not in (0, -signal.SIGTERM):
            print(f"warning: the server exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-3000:]}",
                  file=sys.stderr)


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def request_bodies(n: int, max_tokens: int, temperature: float, words: int, seed: int = 0) -> list[dict]:
    """n distinct chats: a short system message and a user message of words/4 .. words words."""
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(max(1, words // 4), words)))
        bodies.append({"model": "flywheel", "max_tokens": max_tokens, "temperature": temperature,
                       "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": f"{i}: {text}?"}]})
    return bodies


async def run_phase(url: str, bodies: list[dict], clients: int) -> dict:
    """Send every body once from `clients` concurrent workers; per-request latency and usage."""
    import httpx

    n = len(bodies)
    latency, tokens, prompt_tokens = [0.0] * n, [0] * n, [0] * n
    next_index = iter(range(n))  # shared: each free worker takes the next request
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def worker() -> None:
            for i in next_index:
                t = time.perf_counter()
                r = await http.post("/v1/chat/completions", json=bodies[i])
                latency[i] = time.perf_counter() - t
                if r.status_code != 200:
                    raise RuntimeError(f"request {i}: HTTP {r.status_code}: {r.text[:500]}")
                usage = r.json()["usage"]
                tokens[i], prompt_tokens[i] = usage["completion_tokens"], usage["prompt_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(clients, n))))
        wall = time.perf_counter() - t0
    return dict(wall=wall, tokens=sum(tokens), prompt_tokens=sum(prompt_tokens), tok_s=sum(tokens) / wall,
                req_s=n / wall, p50=1e3 * percentile(latency, 0.50), p99=1e3 * percentile(latency, 0.99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    full = dict(clients=32, requests=128, max_tokens=32, rounds=5)
    smoke = dict(clients=8, requests=16, max_tokens=8, rounds=1)
    ap.add_argument("--clients", type=int, help=f"concurrent clients of the concurrent phase ({full['clients']})")
    ap.add_argument("--requests", type=int, help=f"requests per phase, the same list in both ({full['requests']})")
    ap.add_argument("--max-tokens", type=int, help=f"max_tokens of every request ({full['max_tokens']})")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompt-words", type=int, default=12,
                    help="most words of a user message (the tiny model's tokenizer is byte-level: ~6 tokens a word)")
    ap.add_argument("--rounds", type=int, help=f"measured rounds after one warm-up round ({full['rounds']})")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the bench's tiny model)")
    ap.add_argument("--no-traces", action="store_true", help="serve without trace capture")
    ap.add_argument("--smoke", action="store_true",
                    help=f"small sizes where not given ({smoke}); print, append nothing to docs/benchmarks.md")
    args = common.fill_sizes(ap.parse_args(), smoke, full)
    threads = common.set_threads(args.threads)  # what the report states; the server sets its own
    model = args.model or common.tiny_model()
    bodies = request_bodies(args.requests, args.max_tokens, args.temperature, args.prompt_words)
    phases = {"sequential": 1, "concurrent": args.clients}
    results: dict[str, list[dict]] = {p: [] for p in phases}

    with tempfile.TemporaryDirectory(prefix="flywheel-bench-serve-") as tmp:
        traces_db = None if args.no_traces else f"sqlite:///{Path(tmp) / 'traces.db'}"
        with flywheel_server(model, Path(tmp), threads=args.threads, traces_db=traces_db) as url:
            for rnd in range(args.rounds + 1):
                order = list(phases) if rnd % 2 == 0 else list(phases)[::-1]
                for phase in order:
                    r = asyncio.run(run_phase(url, bodies, phases[phase]))
                    tag = "warm-up" if rnd == 0 else f"round {rnd}"
                    print(f"{tag} {phase}: {r['tok_s']:.0f} tok/s, {r['req_s']:.1f} req/s, "
                          f"p50 {r['p50']:.0f} ms, p99 {r['p99']:.0f} ms, {r['tokens']} tokens", flush=True)
                    if rnd:
                        results[phase].append(r)

    keys = ("tok_s", "req_s", "p50", "p99", "tokens", "prompt_tokens")
    med = {p: {k: statistics.median(r[k] for r in rs) for k in keys} for p, rs in results.items()}
    ratios = [c["tok_s"] / s["tok_s"] for s, c in zip(results["sequential"], results["concurrent"])]
    ratio = statistics.median(ratios)
    seq, con = med["sequential"], med["concurrent"]
    lines = [f"Machine: {common.machine_line(threads)} (server process); model: "
             f"{os.path.relpath(model, common.ROOT) if model.is_relative_to(common.ROOT) else model}; "
             f"{args.requests} chat requests per phase, max_tokens {args.max_tokens}, temperature "
             f"{args.temperature}, no seed; traces {'off' if args.no_traces else 'recorded to SQLite'}; "
             f"load generator asyncio + httpx in another process; {args.rounds} rounds after a warm-up, medians.", "",
             "| phase | clients | completion tok/s | req/s | p50 ms | p99 ms | completion tokens / request | "
             "prompt tokens / request |",
             "|---|---|---|---|---|---|---|---|"]
    for p, m in med.items():
        lines.append(f"| {p} | {phases[p]} | {m['tok_s']:,.0f} | {m['req_s']:.1f} | {m['p50']:.0f} | {m['p99']:.0f} | "
                     f"{m['tokens'] / args.requests:.1f} | {m['prompt_tokens'] / args.requests:.0f} |")
    lines += ["", f"ratio concurrent / sequential tokens/s (median of paired rounds): {ratio:.2f}x "
                  f"(range {min(ratios):.2f}-{max(ratios):.2f})"]
    last = (f"serve: ratio={ratio:.2f} concurrent_tok_s={con['tok_s']:.0f} sequential_tok_s={seq['tok_s']:.0f} "
            f"p50_ms={con['p50']:.0f} p99_ms={con['p99']:.0f} clients={args.clients} threads={threads}")
    common.append_report("bench/serve.py: flywheel serve, concurrent vs sequential clients", "\n".join(lines), last,
                         write=not args.smoke)


if __name__ == "__main__":
    main()
