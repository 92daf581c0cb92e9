"""Load on `nanollama4 serve`: 1, 4, 16 and 32 concurrent streaming clients against one server.

Starts the server as a user would (`nanollama4 serve PATH --port 0`, its own process), then for each
level runs that many clients at once, each streaming REQUESTS completions one after another through
httpx: an event loop of light clients, because on a 2-core machine the clients' own parsing takes
CPU from the server (tests/test_serve.py drives the server with `openai`). Reports aggregate
tokens/s, time to first token (TTFT) and inter-token latency (ITL) at p50 and p99, and each level's
throughput over one client's.

    python benchmarks/serve_load.py [--path RUN_OR_HF_DIR] [--dense-peer] [--levels 1,4,16,32] [--stream-interval MS]

Offline `generate` of one client's requests (same prompts, lengths, seeds and thread count as the server)
gives the reference for one served stream, measured in turn with the one-client level (served, offline,
served, offline, ...: on a shared or throttling machine the rate drifts by 20-50% between minutes, so the
two sides are measured in the same minutes). Both sides are measured alike: the same warm-up (long enough
for the engine's runner to finish timing its ways for one row), then the best of --repeats runs (each
level's row is its fastest run).

Without --path it serves a freshly initialised demo-preset (shakespeare-char) model, exported to a
temporary folder: the cost of a step does not depend on what the weights learned. --dense-peer
also loads a fresh dense twin of the same active size (FFN 768 = top-1 expert + shared expert) the
same way: a batch of 16 routes to all 8 experts of each MoE layer, where one request uses one, so the
MoE's batched step grows with the batch faster than the dense model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["ROMEO.\nBut soft, what light through yonder window breaks?\n",
           "JULIET.\nO Romeo, Romeo, wherefore art thou",
           "HAMLET.\nTo be, or not to be, that is the question:\n", "KING LEAR.\nBlow, winds, and crack your cheeks!",
           "MACBETH.\nIs this a dagger which I see before me,\n", "PORTIA.\nThe quality of mercy is not strained;"]


WARM_UP = 64  # tokens of the warm-up request: the runner times each way for 5 steps before it chooses


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one_client(http, url: str, model: str, index: int, requests: int, max_tokens: int, out: dict) -> None:
    """One client: `requests` streamed completions in turn; each token chunk's arrival time recorded."""
    for r in range(requests):
        body = {"model": model, "prompt": PROMPTS[(index + r) % len(PROMPTS)], "max_tokens": max_tokens,
                "temperature": 0.8, "seed": index * 1000 + r, "stream": True}
        sent = time.perf_counter()
        last, tokens = None, 0
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if choice["finish_reason"] is not None:
                    continue
                now = time.perf_counter()
                out["ttft" if last is None else "itl"].append(now - (sent if last is None else last))
                last = now
                tokens += 1
        out["tokens"] += tokens


async def level(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    import httpx

    out: dict = {"ttft": [], "itl": [], "tokens": 0}
    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(one_client(http, url, model, i, requests, max_tokens, out) for i in range(clients)))
        wall = time.perf_counter() - start
    return {"clients": clients, "tokens": out["tokens"], "wall": wall, "tps": out["tokens"] / wall,
            "ttft50": percentile(out["ttft"], 0.5), "ttft99": percentile(out["ttft"], 0.99),
            "itl50": percentile(out["itl"], 0.5), "itl99": percentile(out["itl"], 0.99)}


def demo_model_folder(folder: Path, dense: bool = False) -> Path:
    import torch

    import nanollama4
    from nanollama4.model.tokenizer import CharTokenizer

    text = "".join(PROMPTS) + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'-\n"
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    cfg = nanollama4.preset("shakespeare-char", vocab_size=tok.vocab_size)
    if dense:
        cfg = cfg.replace(n_experts=0, ffn_dim=cfg.expert_dim * (cfg.experts_per_token + int(cfg.shared_expert)))
    nanollama4.export_hf(nanollama4.build_model(cfg, fast=False), folder)
    tok.save(folder / "tokenizer.json")
    return folder


class Offline:
    """Offline `generate` (the same engine, no HTTP) of one client's requests in turn, on the server's thread
    count (`server_threads`), the same prompts, lengths and seeds as one served client."""

    def __init__(self, path: str, args: argparse.Namespace) -> None:
        from nanollama4.interop.hf import load_any

        self.args, self.best = args, float("inf")
        self.model, self.tok = load_any(path)
        self.run(warm_up=True)

    def run(self, warm_up: bool = False) -> None:
        import torch

        from nanollama4.engine.generation import generate

        threads = torch.get_num_threads()
        torch.set_num_threads(server_threads(self.args))
        try:
            if warm_up:  # as the server's
                generate(self.model, self.tok, PROMPTS[0], WARM_UP, temperature=0.8, seed=0)
                return
            start = time.perf_counter()
            for r in range(self.args.requests):
                generate(self.model, self.tok, PROMPTS[r % len(PROMPTS)], self.args.max_tokens, temperature=0.8, seed=r)
            self.best = min(self.best, time.perf_counter() - start)
        finally:
            torch.set_num_threads(threads)

    @property
    def rate(self) -> float:
        return self.args.requests * self.args.max_tokens / self.best


def server_threads(args: argparse.Namespace) -> int:
    """The server's thread count: --threads, else its default (the cores less one)."""
    return args.threads or max(1, (os.cpu_count() or 2) - 1)


def sweep(path: str, levels: list[int], args: argparse.Namespace, offline: Offline) -> list[dict]:
    """The load levels against one `nanollama4 serve PATH` process; offline generate in turn with the
    one-client level's runs."""
    interval = [] if args.stream_interval is None else ["--stream-interval", str(args.stream_interval)]
    threads = [] if args.threads is None else ["--threads", str(args.threads)]
    server = subprocess.Popen([sys.executable, "-m", "nanollama4", "serve", path, "--port", "0",
                               "--max-batch", str(args.max_batch), "--name", "bench", *interval, *threads],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = re.search(r"http://[0-9.]+:\d+", server.stdout.readline())[0]
        asyncio.run(level(url, "bench", 1, 1, WARM_UP))  # warm-up: first-call allocations, the runner's trials
        runs = []
        for c in levels:
            rows = []
            for _ in range(args.repeats):
                rows.append(asyncio.run(level(url, "bench", c, args.requests, args.max_tokens)))
                if c == 1:
                    offline.run()
            runs.append(rows)
        if 1 not in levels:
            for _ in range(args.repeats):
                offline.run()
        return [max(rows, key=lambda row: row["tps"]) for rows in runs]
    finally:
        server.terminate()
        server.wait(60)


def versus(alone: float, rows: list[dict]) -> str:
    """Offline tokens/s, and one served stream's share of it where the levels measured one."""
    one = [r["tps"] for r in rows if r["clients"] == 1]
    return f"{alone:.0f} tokens/s" + (f" (one served stream: {one[0] / alone:.2f}x)" if one else "")


def table(title: str, rows: list[dict]) -> str:
    lines = [title, "",
             "| clients | tokens | wall s | tokens/s | × one client | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
             "| ITL p99 ms |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    one = rows[0]["tps"] if rows[0]["clients"] == 1 else float("nan")
    for r in rows:
        lines.append(f"| {r['clients']} | {r['tokens']} | {r['wall']:.1f} | {r['tps']:.0f} | {r['tps'] / one:.1f} | "
                     f"{1000 * r['ttft50']:.0f} | {1000 * r['ttft99']:.0f} | {1000 * r['itl50']:.1f} | "
                     f"{1000 * r['itl99']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", help="a run or transformers checkpoint folder (default: a fresh demo model)")
    parser.add_argument("--dense-peer", action="store_true", help="also a fresh dense twin of the same active size")
    parser.add_argument("--levels", default="1,4,16,32")
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--stream-interval", type=int, metavar="MS", help="the server's (default: its own)")
    parser.add_argument("--threads", type=int, help="the server's and offline generate's (default: the server's own, "
                        "the cores less one)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each level and of offline generate; "
                        "the fastest is reported")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"serve_load: max_tokens {args.max_tokens}, {args.requests} streamed requests per client, "
          f"--max-batch {args.max_batch}, best of {args.repeats}; CPU: {cpu}, {os.cpu_count()} cores; "
          f"{time.strftime('%Y-%m-%d')}\n")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.path or str(demo_model_folder(Path(tmp) / "demo"))
        offline = Offline(path, args)
        rows = sweep(path, levels, args, offline)
        print(table(f"MoE: {args.path or 'fresh demo-preset model (8 experts, top-1 + shared)'}", rows))
        print(f"\noffline generate, same prompts and settings: {versus(offline.rate, rows)}", flush=True)
        if args.dense_peer:
            dense = str(demo_model_folder(Path(tmp) / "dense", dense=True))
            offline = Offline(dense, args)
            rows = sweep(dense, levels, args, offline)
            print()
            print(table("dense twin of the same active size (FFN 768), fresh", rows))
            print(f"\noffline generate, same prompts and settings: {versus(offline.rate, rows)}", flush=True)

if __name__ == "__main__":
    main()
