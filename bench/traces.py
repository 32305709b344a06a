"""Trace ingestion: POST /v1/traces in batches of 500 into SQLite vs TraceStore.add_traces, same run.

Protocol. The real server (`flywheel serve` in a subprocess, serving the bench's tiny model,
whose trace store is a fresh SQLite file in a temp folder) takes traces on POST /v1/traces.
A trace is what an agent stack sends (~1.9 KB of JSON): a system prompt, a user turn, an
assistant turn with a tool call, the tool's result, the tools offered, the final assistant
response, usage, latency and metadata, with an idempotency key (the store assigns the ids).
Traces are live traffic: their created_at runs on, 37 ms apart, through the whole run. (Until
2026-12-02 every measurement re-sent the same 12 minutes of timestamps, a backfill pattern:
each batch's created_at index entries landed among all the earlier ones, and the write of a
batch grew from ~32 to ~96 us a trace over 100 batches; with live timestamps it stays flat.)

One measurement = `--total` fresh traces (generated before the clock starts):
  http (P posters): P asyncio tasks, each on its own keep-alive connection (asyncio streams,
      a lean load generator like wrk: it shares the 2 cores with the server; `--client httpx`
      for httpx), each posting the next batch
      of 500 as soon as its previous answer arrived; the clock covers JSON encoding (orjson,
      as a client that batches for throughput would; httpx's `json=` takes the stdlib's
      json.dumps, ~25 ms a batch on a 2-core bench machine, as long as the server's whole
      work on it), the request, the server's decoding, validation and committed write, and
      the answer. Every answer must report all 500 added. The server runs with its default
      ingestion workers (`flywheel serve --ingest-workers`: the CPU count, at most 4).
  direct (the peer): the same records, in the same batches, through TraceStore.add_traces
      in this process into a second fresh SQLite file (no HTTP, no JSON on the way in, one
      core). Like the server, this process freezes what it imported (`gc.freeze`) first.
Each round measures, for each P in --posters, http then direct (the order alternates between
rounds), so both databases grow alike; round 0 warms up and is dropped. Reported: medians of
traces/s over rounds and the median of the paired http / direct ratios. The headline
(`traces_per_s`) is the first P of --posters, 4 by default: a few agent stacks posting at
once, which is what an ingestion rate means; P=1 shows one client that waits for each answer
before it sends the next batch, P=8 a heavier load.

Afterwards the server is stopped and the HTTP database is read back with
TraceStore.iter_traces: the count, the ids (as the answers gave them), the idempotency keys
and every trace's messages / tools / response must match what was sent, else the bench fails.

Smoke run (prints, appends nothing): `python bench/traces.py --smoke`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from serve import flywheel_server  # noqa: E402

CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Denver", "Tunis", "Hanoi", "Perth", "Quito"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather and a 3-day forecast for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. 'Lisbon'"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search_docs", "description": "Search the internal knowledge base.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
SYSTEM = ("You are a travel assistant for Acme Corp employees. Answer briefly, cite the tool results you used, "
          "and never invent weather data: call get_weather when the user asks about conditions somewhere.")


TRACE_GAP = timedelta(milliseconds=37)  # between two traces' created_at


def make_trace(tag: str, i: int, rng: random.Random, t0: datetime) -> dict:
    city, other = rng.sample(CITIES, 2)
    temp, wind = rng.randint(-5, 35), rng.randint(0, 60)
    call_id = f"call_{tag}_{i}"
    args = json.dumps({"city": city, "unit": "celsius"})
    tool_result = json.dumps({"city": city, "temp_c": temp, "wind_kmh": wind, "conditions": rng.choice(
        ["clear", "overcast", "light rain", "snow showers", "thunderstorms"]),
        "forecast": [{"day": d, "high": temp + rng.randint(-3, 3), "low": temp - rng.randint(2, 8)}
                     for d in (1, 2, 3)]})
    prompt_tokens, completion_tokens = rng.randint(180, 420), rng.randint(20, 90)
    return {
        "idempotency_key": f"bench-{tag}-{i:07d}",
        "created_at": (t0 + TRACE_GAP * i).isoformat(),
        "source": "agent:travel-bot",
        "model": "travel-assistant",
        "model_version": f"v{rng.randint(1, 4)}",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"I fly to {city} from {other} on Friday. Do I need a coat? "
                                        f"Request #{i} of session {tag}."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": call_id, "content": tool_result},
        ],
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
        "response": {"role": "assistant", "content": f"{city} is {temp}°C with wind at {wind} km/h; "
                                                     f"{'bring a coat' if temp < 15 else 'a light jacket is enough'}."},
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "latency_ms": round(rng.uniform(150, 2500), 1),
        "metadata": {"session_id": f"s-{tag}-{i // 8}", "user_id": f"u{rng.randint(1, 5000)}", "env": "prod",
                     "app_version": "2.14.1", "tags": ["travel", rng.choice(["mobile", "web", "slack"])]},
    }


JSON_HEADERS = {"content-type": "application/json"}


def digest(messages, tools, response) -> str:
    return hashlib.sha256(json.dumps([messages, tools, response], sort_keys=True).encode()).hexdigest()


async def post_all(url: str, batches: list[list[dict]], posters: int, client: str = "raw") -> tuple[float, list[str]]:
    """Post every batch from `posters` concurrent tasks; (seconds, ids in record order)."""
    ids: list[list[str] | None] = [None] * len(batches)
    next_batch = iter(range(len(batches)))
    open_poster = _raw_poster if client == "raw" else _httpx_poster

    async def poster() -> None:
        async with open_poster(url) as post:
            for b in next_batch:
                status, raw = await post(orjson.dumps({"traces": batches[b]}))
                if status != 200:
                    raise RuntimeError(f"batch {b}: HTTP {status}: {raw[:500]!r}")
                body = orjson.loads(raw)
                if body["added"] != len(batches[b]):
                    bad = [x for x in body["results"] if x["status"] != "added"][:3]
                    raise RuntimeError(f"batch {b}: {body['added']} of {len(batches[b])} added: {bad}")
                ids[b] = [x["id"] for x in body["results"]]

    t0 = time.perf_counter()
    await asyncio.gather(*(poster() for _ in range(min(posters, len(batches)))))
    dt = time.perf_counter() - t0
    return dt, [i for chunk in ids for i in chunk]


@contextlib.asynccontextmanager
async def _raw_poster(url: str):
    """One keep-alive HTTP/1.1 connection on asyncio streams: a load generator that spends
    as little of the shared CPU as it can (as wrk does), where httpx's pure-Python layers
    take ~10 us a trace on this machine. Yields post(body) -> (status, response body)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = f"POST /v1/traces HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"

    async def post(body: bytes) -> tuple[int, bytes]:
        writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode())
        writer.write(body)
        lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
        return int(lines[0].split()[1]), await reader.readexactly(int(headers["content-length"]))

    try:
        yield post
    finally:
        writer.close()
        await writer.wait_closed()


@contextlib.asynccontextmanager
async def _httpx_poster(url: str):
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def post(body: bytes) -> tuple[int, bytes]:
            r = await http.post("/v1/traces", content=body, headers=JSON_HEADERS)
            return r.status_code, r.content

        yield post


def insert_direct(store, batches: list[list[dict]]) -> float:
    t0 = time.perf_counter()
    for b, batch in enumerate(batches):
        result = store.add_traces(batch)
        if result.added != len(batch):
            raise RuntimeError(f"direct batch {b}: {result.added} of {len(batch)} added: {result.rejected[:3]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    full = dict(total=20_000, rounds=5)
    smoke = dict(total=2_000, rounds=1)
    ap.add_argument("--total", type=int, help=f"traces per measurement ({full['total']})")
    ap.add_argument("--batch", type=int, default=500, help="traces per POST / add_traces call")
    ap.add_argument("--posters", default="4,1,8",
                    help="comma-separated numbers of concurrent posting clients; the first is the headline")
    ap.add_argument("--client", choices=["raw", "httpx"], default="raw",
                    help="the posters' HTTP client: asyncio streams (lean, like wrk) or httpx")
    ap.add_argument("--ingest-workers", type=int, help="the server's --ingest-workers (default: the server's own)")
    ap.add_argument("--rounds", type=int, help=f"measured rounds after one warm-up round ({full['rounds']})")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server (it serves no model here)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"small sizes where not given ({smoke}); print, append nothing to docs/benchmarks.md")
    args = common.fill_sizes(ap.parse_args(), smoke, full)
    posters = [int(p) for p in args.posters.split(",")]
    threads = common.set_threads(args.threads)
    model = common.tiny_model()
    from flywheel.traces import TraceStore
    from flywheel.serve.ingest_pool import default_ingest_workers

    workers = default_ingest_workers() if args.ingest_workers is None else args.ingest_workers
    gc.collect()
    gc.freeze()

    t_start = datetime(2025, 1, 1, tzinfo=timezone.utc)
    sent: dict[str, tuple[str, str]] = {}  # idempotency key -> (id from the answer, content digest)
    http_rates = {p: [] for p in posters}
    direct_rates = {p: [] for p in posters}
    sizes: list[int] = []
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-traces-") as tmp:
        tmp = Path(tmp)
        http_db, direct_db = tmp / "http.db", tmp / "direct.db"
        with TraceStore(f"sqlite:///{direct_db}") as direct:
            with flywheel_server(model, tmp, threads=args.threads, traces_db=f"sqlite:///{http_db}",
                                 extra=("--ingest-workers", str(workers))) as url:
                for rnd in range(args.rounds + 1):
                    for p in posters:
                        tag = f"r{rnd}p{p}"
                        rng = random.Random(tag)
                        records = [make_trace(tag, i, rng, t_start) for i in range(args.total)]
                        t_start += TRACE_GAP * args.total  # the next measurement's traffic comes later
                        sizes.append(len(json.dumps(records[0])))
                        batches = [records[s:s + args.batch] for s in range(0, len(records), args.batch)]
                        http_first = rnd % 2 == 0
                        if not http_first:
                            d_dt = insert_direct(direct, batches)
                        h_dt, ids = asyncio.run(post_all(url, batches, p, args.client))
                        if http_first:
                            d_dt = insert_direct(direct, batches)
                        for rec, trace_id in zip(records, ids):
                            sent[rec["idempotency_key"]] = (trace_id, digest(rec["messages"], rec["tools"],
                                                                              rec["response"]))
                        h, d = args.total / h_dt, args.total / d_dt
                        print(f"{'warm-up' if rnd == 0 else f'round {rnd}'} posters={p}: http {h:,.0f} traces/s, "
                              f"direct {d:,.0f} traces/s, ratio {h / d:.2f}", flush=True)
                        if rnd:
                            http_rates[p].append(h)
                            direct_rates[p].append(d)
                direct_count = direct.count()
            # the server is stopped: read back everything it acknowledged
            t0 = time.perf_counter()
            seen = 0
            with TraceStore(f"sqlite:///{http_db}") as store:
                for t in store.iter_traces(include_feedback=False):
                    seen += 1
                    expected = sent.get(t.idempotency_key)
                    if expected is None:
                        raise SystemExit(f"FAIL: read back a trace that was never sent: {t.id} ({t.idempotency_key})")
                    if t.id != expected[0]:
                        raise SystemExit(f"FAIL: {t.idempotency_key} stored as {t.id}, the answer said {expected[0]}")
                    if digest(t.messages, t.tools, t.response) != expected[1]:
                        raise SystemExit(f"FAIL: trace {t.id} does not read back as it was sent")
                stored = store.count()
            read_s = time.perf_counter() - t0
    if seen != len(sent) or stored != len(sent):
        raise SystemExit(f"FAIL: {len(sent)} traces accepted, {seen} read back, count() says {stored}")
    if direct_count != len(sent):
        raise SystemExit(f"FAIL: the direct store holds {direct_count} traces, expected {len(sent)}")

    head = posters[0]
    med = {p: (statistics.median(http_rates[p]), statistics.median(direct_rates[p]),
               statistics.median(h / d for h, d in zip(http_rates[p], direct_rates[p]))) for p in posters}
    lines = [f"Machine: {common.machine_line(threads)}; server: `flywheel serve` in a subprocess (tiny model, idle, "
             f"{workers} ingestion workers), "
             f"SQLite in a temp folder; traces of ~{int(statistics.median(sizes)):,} bytes of JSON "
             f"(4 messages with a tool call, 2 tools, response, usage, metadata, idempotency key); "
             f"{args.total:,} traces per measurement in batches of {args.batch}; {args.rounds} rounds after a "
             f"warm-up, medians.", "",
             "| posting clients | POST /v1/traces traces/s | TraceStore.add_traces traces/s | http / direct |",
             "|---|---|---|---|"]
    for p, (h, d, r) in med.items():
        lines.append(f"| {p} | {h:,.0f} | {d:,.0f} | {r:.2f} |")
    lines += ["", f"Read back afterwards through TraceStore.iter_traces: all {seen:,} accepted traces (ids, keys and "
                  f"content as sent) in {read_s:.1f} s ({seen / read_s:,.0f} traces/s)."]
    h, d, r = med[head]
    extra = " ".join(f"traces_per_s_{p}posters={med[p][0]:.0f}" for p in posters[1:])
    last = (f"traces: traces_per_s={h:.0f} direct_traces_per_s={d:.0f} ratio={r:.2f} batch={args.batch} "
            f"total={args.total} posters={head} workers={workers} {extra} read_back={seen}").rstrip()
    common.append_report("bench/traces.py: POST /v1/traces vs TraceStore.add_traces", "\n".join(lines), last,
                         write=not args.smoke)


if __name__ == "__main__":
    main()
