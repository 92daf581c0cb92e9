"""The GPU check, in one process: parity on the device, the routed layer against the dense FFN, a demo
training step's tokens/s and MFU, the `gpu` preset's training step (eager and compiled), and batch-1/16
decode with and without CUDA graphs. `benchmarks/gpu.sh` runs it on a CUDA machine.

1. **Parity.** The fast model (`ops.install`, which picks grouped_mm for bf16 on CUDA) against the plain one on
   the same device and weights, each tensor as a whole (the norm of the difference over the norm): in
   float32 the logits and every gradient of the loss (to 1e-4); under bf16 autocast the routed experts'
   output and gradients on the same assignments (to 2e-2; in the whole model bf16 rounding flips a few
   routing decisions, after which the two paths differ by routing, not by arithmetic); for routings with
   capacity and overflow, top-1 and top-2, the shared expert on and off; and the float32 logits on the
   device against float64 on the CPU.
2. **The routed layer against the dense FFN** of equal active width (top-k experts + the shared one), one
   forward + backward under bf16 autocast, median ms, at the demo's 32 x 256 tokens and at 64 x 1024.
3. **A demo training step** (`make demo`'s recipe: bf16, Muon, batch 32 x 256; and batch 256 x 256):
   tokens/s and the model FLOPs utilisation against the chip's peak (`--peak-tflops`, or a table of names).
4. **The `gpu` preset** (~0.7 B parameters, 0.2 B active; its dense twin of the same active size): a training
   step eager (and, for comparison, with the chunked layers' attention as one masked pass, as before
   `attention.by_chunks`), each block through torch.compile (with Muon on every expert, or on two a step),
   and the whole model compiled with mode "reduce-overhead" (the step replayed as CUDA graphs): tokens/s,
   MFU, the optimizer's own time and host syncs.
5. **Decode**: greedy tokens/s at batch 1 and 16 through the engine (`generation.generate_ids`): the default
   (on CUDA, steps replayed as CUDA graphs: `engine.graphs`) against the plain step, and host syncs a step.

    python benchmarks/gpu.py [--device cuda] [--quick] [--peak-tflops 989]

`--device cpu --quick` is the dry run `make test` makes (tests/test_gpu_check.py): every section on tiny
shapes; the compiled rows are skipped there (compiling takes minutes on a 2-core CPU) and say so.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from functools import partial

import torch

from nanollama4.base.config import TrainConfig, preset
from nanollama4.engine.cache import SlotCache
from nanollama4.engine.generation import generate_ids
from nanollama4.engine.runner import Runner
from nanollama4.model.attention import BY_CHUNKS
from nanollama4.model.memory import param_counts
from nanollama4.model.moe import SwiGLU
from nanollama4.model.transformer import Transformer
from nanollama4.ops import install
from nanollama4.training.optim import make_optimizer

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}  # dense bf16
ROUTINGS = {  # name -> ModelConfig changes on the demo preset
    "demo (sigmoid top-1, shared, bias)": {},
    "tutorial (softmax top-2, capacity 1.0, overflow)": dict(router="softmax", experts_per_token=2,
                                                             capacity_factor=1.0),
    "no shared expert, capacity 0.5 (drops)": dict(shared_expert=False, capacity_factor=0.5),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int, warm: int = 3) -> float:
    """Median seconds of fn() over `reps` calls after `warm` untimed ones."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(a).clamp(min=1e-12))


def _experts_pass(experts: torch.nn.Module, x: torch.Tensor, assignments: tuple, scales_input: bool,
                  bf16: bool) -> list[torch.Tensor]:
    """The routed experts' output and the gradients of x and of their weights, on fixed assignments."""
    experts.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        y = experts(x, *assignments, scales_input)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=x.device).view_as(y)).sum().backward()
    return [y.detach().float(), x.grad.float(), *(p.grad.float() for p in experts.parameters())]


def parity(device: torch.device, batch: int, seq: int) -> bool:
    print("## 1. parity: the fast model against the plain one on the device")
    ok = True
    for name, changes in ROUTINGS.items():
        cfg = preset("shakespeare-char", **changes)
        torch.manual_seed(0)
        plain = Transformer(cfg).to(device).train()
        fast = install(copy.deepcopy(plain))
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
        grads = []
        for model in (plain, fast):  # float32, the whole model: logits and every gradient of the loss
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            logits = model(ids)
            model.loss(ids[:, :-1], ids[:, 1:]).total.backward()
            grads.append([logits.detach()] + [p.grad for p in model.parameters()])
        worst = max(_relative(a, b) for a, b in zip(*grads, strict=True))
        # bf16, the routed experts on the same assignments: in the whole model, bf16 rounding upstream flips
        # a few routing and capacity decisions, after which the paths differ by what routing they took
        layer = plain.blocks[0].ffn
        x = torch.randn(batch * seq, cfg.d_model, device=device)
        with torch.no_grad():
            assignments = layer.route(x).assignments()
        fast_experts = fast.blocks[0].ffn.experts
        if device.type == "cuda":  # the product auto picks for bf16 on CUDA, compared explicitly
            fast_experts.dispatch = "grouped"
        worst_bf16 = max(_relative(a, b) for a, b in zip(
            _experts_pass(layer.experts, x, assignments, layer.router.scales_input, True),
            _experts_pass(fast_experts, x, assignments, layer.router.scales_input, True), strict=True))
        good = worst <= 1e-4 and worst_bf16 <= 2e-2
        ok &= good
        print(f"- {name}: float32 model, largest |difference| / |plain| over the logits and every gradient "
              f"{worst:.1e} (<= 1e-4); bf16 routed experts on the same assignments, over the output and every "
              f"gradient {worst_bf16:.1e} (<= 2e-2){'' if good else ': FAILED'}")
    cfg = preset("shakespeare-char")
    torch.manual_seed(0)
    cpu = Transformer(cfg).double().eval()
    dev = install(copy.deepcopy(cpu).float().to(device))
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with torch.no_grad():
        diff = float((dev(ids.to(device)).double().cpu() - cpu(ids)).abs().max())
    ok &= diff <= 1e-3
    print(f"- float32 logits on {device} against float64 on the CPU: max |difference| {diff:.1e} (<= 1e-3)")
    return ok


def layer_against_dense(device: torch.device, shapes: list[tuple[int, int]], reps: int, wide: bool = True) -> None:
    print("\n## 2. one routed layer against the dense FFN of equal active width, bf16 autocast, forward + backward")
    print("The demo's widths (d_model 256, 8 experts of 384, top-1 + shared) and four times them (1024, 1536).")
    print("| widths | tokens | product | MoE layer ms | dense FFN ms | ratio | host syncs per step |")
    print("|---|---:|---|---:|---:|---:|---:|")
    demo = preset("shakespeare-char")
    widths = [("demo", demo)]
    if wide:  # (not in the CPU dry run: a second of bf16 products for the same code)
        widths.append(("4x demo", demo.replace(d_model=1024, n_heads=16, n_kv_heads=4, expert_dim=1536, ffn_dim=3072,
                                               n_layers=1)))
    for label, cfg in widths:
        torch.manual_seed(0)
        moe = install(Transformer(cfg).blocks[0].ffn).to(device).train()
        dense = install(SwiGLU(cfg.d_model, cfg.expert_dim * (cfg.experts_per_token + 1))).to(device).train()
        for batch, seq in shapes:
            x = torch.randn(batch, seq, cfg.d_model, device=device, requires_grad=True)
            d = timed(partial(_layer_step, dense, x), device, reps)
            for product in ("loop", "grouped") if device.type == "cuda" else ("auto",):
                moe.experts.dispatch = product
                m = timed(partial(_layer_step, moe, x), device, reps)
                print(f"| {label} | {batch} x {seq} | {product} | {m * 1e3:.2f} | {d * 1e3:.2f} | {m / d:.2f} "
                      f"| {_host_syncs(partial(_layer_step, moe, x), device)} |")
            moe.experts.dispatch = "auto"


def _host_syncs(fn, device: torch.device) -> str:
    """How many times fn() waits for the GPU from the host (CUDA's sync debug mode, counted as warnings)."""
    if device.type != "cuda":
        return "-"
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return str(sum("synchroniz" in str(w.message) for w in caught))


def _layer_step(module: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = module(x)
    out.float().sum().backward()


def _train_step(model: Transformer, opt: torch.optim.Optimizer, ids: torch.Tensor, graphs: bool = False) -> None:
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model.loss(ids[:, :-1], ids[:, 1:]).total
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def training_step(device: torch.device, batches: list[int], reps: int, peak: float | None, seq: int = 256,
                  quick: bool = False) -> None:
    print(f"\n## 3. a demo training step (bf16 autocast, Muon at 0.02, AdamW part 2e-3), seq_len {seq}")
    print("| model | batch | ms / step | optimizer ms | host syncs | tokens/s | model TFLOP/s | MFU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    moe = preset("shakespeare-char")
    twin = moe.replace(n_experts=0, ffn_dim=2 * moe.expert_dim)
    wide = moe.replace(n_experts=16)
    arms = (("MoE", moe, True), ("MoE, experts on AdamW", moe, False), ("MoE N=16", wide, True),
            ("MoE N=16, experts on AdamW", wide, False), ("dense twin", twin, True))
    if quick:  # the dry run: the first and the last arm run the same code as the others
        arms = (arms[0], arms[-1])
    for name, cfg, muon_experts in arms:
        torch.manual_seed(0)
        model = install(Transformer(cfg)).to(device).train()
        opt = make_optimizer(model, TrainConfig(optimizer="muon", lr=2e-3, min_lr=2e-4,
                                                       settings={"muon": {"experts": muon_experts}}))
        counts = param_counts(cfg)
        active = counts.active - counts.embedding  # the embedding is a lookup, not a product
        for batch in batches:
            ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
            seconds = timed(partial(_train_step, model, opt, ids), device, reps)
            syncs = _host_syncs(partial(_train_step, model, opt, ids), device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                model.loss(ids[:, :-1], ids[:, 1:]).total.backward()
            step = timed(opt.step, device, reps)  # the optimizer alone, on the gradients of one batch
            opt.zero_grad(set_to_none=True)
            tokens = batch * seq
            # 6 FLOPs per active weight per token (forward and backward), and causal attention's scores and
            # weighted sums: 6 x layers x heads x head_dim x (seq / 2) per token
            flops = tokens * (6 * active + 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq / 2)
            tflops = flops / seconds / 1e12
            mfu = f"{100 * tflops / peak:.2f}%" if peak else "peak unknown"
            print(f"| {name} | {batch} | {seconds * 1e3:.1f} | {step * 1e3:.1f} | {syncs} | {tokens / seconds:,.0f} "
                  f"| {tflops:.2f} | {mfu} |")


@contextmanager
def _whole_masks():
    """The chunked layers' attention as before `attention.by_chunks`: one masked pass over the whole sequence."""
    saved = set(BY_CHUNKS)
    BY_CHUNKS.clear()
    try:
        yield
    finally:
        BY_CHUNKS.update(saved)


# name -> (what it does to the model, in place; Muon's settings; a context the steps run in)
GPU_MODES = {
    "eager": (lambda model: None, {}, nullcontext),
    "eager, whole-sequence masks": (lambda model: None, {}, _whole_masks),
    "compiled blocks": (lambda model: [b.compile() for b in model.blocks], {}, nullcontext),
    "compiled blocks, Muon on 2 experts a step": (lambda model: [b.compile() for b in model.blocks],
                                                  {"experts_per_step": 2}, nullcontext),
    "compiled whole, reduce-overhead": (lambda model: model.compile(mode="reduce-overhead"), {}, nullcontext),
}


def gpu_preset(device: torch.device, batch: int, seq: int, reps: int, peak: float | None, quick: bool,
               deadline: float = float("inf")) -> None:
    print(f"\n## 4. the gpu preset: a training step (bf16 autocast, Muon, batch {batch} x {seq})")
    print("| model | params | active | mode | ms / step | optimizer ms | host syncs | tokens/s | model TFLOP/s | MFU |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    moe = preset("gpu", max_seq_len=seq)
    if quick:  # the same layout at a size a CPU steps through in a moment
        moe = moe.replace(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=256,
                          expert_dim=128, vocab_size=512, attention_chunk_size=seq // 4, floor_scale=seq // 4)
    twin = moe.replace(n_experts=0, ffn_dim=2 * moe.expert_dim)
    modes = [m for m in GPU_MODES if device.type == "cuda" or not m.startswith("compiled")]
    for mode in modes:  # (each mode for both models before the next: a slow compile leaves the others measured)
        for name, cfg in (("MoE", moe), ("dense twin", twin)):
            if "experts a step" in mode and not cfg.n_experts:
                continue
            if mode.startswith("compiled") and time.monotonic() > deadline - 150:
                print(f"| {name} | | | {mode} | skipped: under 150 s of --budget left | | | | | |", flush=True)
                continue
            try:
                _gpu_row(device, name, cfg, mode, batch, seq, reps, peak)
            except Exception as e:  # a mode this torch or chip cannot run: a row that says so
                first = (str(e).splitlines() or [""])[0][:80]
                print(f"| {name} | | | {mode} | failed: {type(e).__name__}: {first} | | | | | |", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if device.type != "cuda":
        print("(compiled modes skipped off CUDA: compiling takes minutes on a small CPU)")


def _gpu_row(device: torch.device, name: str, cfg, mode: str, batch: int, seq: int, reps: int,
             peak: float | None) -> None:
    counts = param_counts(cfg)
    active = counts.active - counts.embedding
    prepare, muon, context = GPU_MODES[mode]
    torch.manual_seed(0)
    model = install(Transformer(cfg)).to(device).train()
    opt = make_optimizer(model, TrainConfig(optimizer="muon", lr=2e-3, min_lr=2e-4, settings={"muon": muon}))
    prepare(model)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    graphs = "reduce-overhead" in mode  # (a new step's graphs may overwrite the last step's outputs)
    with context():
        seconds = timed(partial(_train_step, model, opt, ids, graphs), device, reps)
        syncs = _host_syncs(partial(_train_step, model, opt, ids, graphs), device)
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            model.loss(ids[:, :-1], ids[:, 1:]).total.backward()
    step = timed(opt.step, device, max(2, reps // 2))  # the optimizer alone
    tokens = batch * seq
    flops = tokens * (6 * active + 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq / 2)
    tflops = flops / seconds / 1e12
    mfu = f"{100 * tflops / peak:.1f}%" if peak else "peak unknown"
    print(f"| {name} | {counts.total / 1e6:,.1f}M | {active / 1e6:,.1f}M | {mode} | {seconds * 1e3:.1f} "
          f"| {step * 1e3:.1f} | {syncs} | {tokens / seconds:,.0f} | {tflops:.2f} | {mfu} |", flush=True)


def decode(device: torch.device, rows: list[int], new: int) -> None:
    print(f"\n## 5. greedy decode through the engine, {new} new tokens after a 16-token prompt")
    print("| model | batch | default tokens/s | plain tokens/s | default / plain | host syncs a step (default) |")
    print("|---|---:|---:|---:|---:|---:|")
    moe = preset("shakespeare-char")
    for name, cfg in (("MoE", moe), ("dense twin", moe.replace(n_experts=0, ffn_dim=2 * moe.expert_dim))):
        torch.manual_seed(0)
        model = install(Transformer(cfg)).to(device).eval()
        for b in rows:
            prompts = [list(range(1, 17)) for _ in range(b)]
            rate = {}
            for way in (None, "plain"):
                Runner.only = way
                try:
                    generate_ids(model, prompts, 8, temperature=0)  # warm-up (and the graphs' capture)
                    sync(device)
                    start = time.perf_counter()
                    generate_ids(model, prompts, new, temperature=0)
                    sync(device)
                    rate[way] = b * new / (time.perf_counter() - start)
                finally:
                    Runner.only = None
            syncs = _decode_syncs(model, b, device)
            print(f"| {name} | {b} | {rate[None]:,.0f} | {rate['plain']:,.0f} | {rate[None] / rate['plain']:.2f} "
                  f"| {syncs} |", flush=True)


def _decode_syncs(model: Transformer, rows: int, device: torch.device) -> str:
    """Host syncs in one steady-state decode step of the runner (the model's pass, not the sampling after it)."""
    cache = SlotCache(model.cfg, rows, next(model.parameters()).dtype, device)
    runner = Runner(model, cache)
    with torch.no_grad():
        for s in range(3):
            runner.decode([1] * rows, [s] * rows)
        return _host_syncs(lambda: runner.decode([1] * rows, [3] * rows), device)


SECTIONS = {"1": "parity", "2": "layer", "3": "demo step", "4": "gpu preset", "5": "decode"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes and few repetitions (a check of the script)")
    ap.add_argument("--peak-tflops", type=float, help="the chip's dense bf16 peak (default: by its name)")
    ap.add_argument("--sections", default="1,2,3,4,5",
                    help="which sections to run, in this order (a lease's one try runs what matters most first)")
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds this run may take: a compiled row that would start with under 150 s left is "
                         "skipped and says so, so that one slow compile does not cost the rows after it")
    args = ap.parse_args()
    device = torch.device(args.device)
    deadline = time.monotonic() + args.budget
    peak = args.peak_tflops
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        print(f"{name}, torch {torch.__version__}, peak bf16 {peak or 'unknown'} TFLOP/s")
    else:
        print(f"{device}, torch {torch.__version__}")
    quick = args.quick
    run = {
        "1": lambda: parity(device, 2 if quick else 8, 32 if quick else 256),
        "2": lambda: layer_against_dense(device, [(4, 64)] if quick else [(32, 256), (64, 1024)],
                                         3 if quick else 20, wide=not quick),
        "3": lambda: training_step(device, [2] if quick else [32, 256], 2 if quick else 10, peak,
                                   64 if quick else 256, quick),
        "4": lambda: gpu_preset(device, 2 if quick else 16, 64 if quick else 2048, 2 if quick else 10, peak, quick,
                                deadline),
        "5": lambda: decode(device, [1, 2] if quick else [1, 16], 8 if quick else 224),
    }
    sections = [part.strip() for part in args.sections.split(",")]
    if unknown := [part for part in sections if part not in run]:
        ap.error(f"--sections: no section {', '.join(unknown)}; the sections are {', '.join(run)}")
    failed = []
    for section in sections:
        start = time.monotonic()
        try:  # a section that breaks on this device or torch says how, and the next one still runs
            if run[section]() is False:
                failed.append(f"{section} ({SECTIONS[section]}: a check failed)")
        except Exception:
            traceback.print_exc()
            failed.append(f"{section} ({SECTIONS[section]}: raised)")
        print(f"(section {section} took {time.monotonic() - start:.0f} s)", flush=True)
    if failed:
        raise SystemExit("failed: " + ", ".join(failed))


if __name__ == "__main__":
    main()
