"""Our one compiled kernel: the feed-forward layers' matrix products on the CPU, in float32, and in bf16
where the CPU has AVX512_BF16 (`bf16_available()`).

torch's CPU products are built for large matrices. An expert that sees a few dozen rows spends most of a
product packing its weight, and both cores synchronise on every product, so an MoE layer with many experts
ran several times slower than a dense layer of the same active size (measured 2026-11-29, see git history
of benchmarks/RESULTS.md). `csrc/grouped.cpp` gives each core whole experts and multiplies with
register-tiled loops that read every weight element once. It is compiled with torch's C++ extension tools
on first use (about 20 s, cached afterwards under ~/.cache/torch_extensions, one build per source and
flags); where that is impossible (no compiler), or with NANOLLAMA4_CPU_KERNELS=0, `available()` is False
and the MoE layer keeps torch's `grouped_mm`. The float32 loops pay only with AVX-512 (`fp32_pays()`);
elsewhere torch's products are the faster ones and `auto` keeps them.

The bf16 products follow the same plan on the CPU's bf16 dot-product instruction, with float32 sums; they
take float32 master weights as they are (each core casting the part it multiplies) and write float32 gradients, so
an autocast MoE step has no cast of its experts and no bf16 round trip of their gradients. The same
module holds the SwiGLU activation between the two products (AVX-512).

The same loops also beat torch's fp32 products at dense sizes (measured 2026-11-29, see git history of
benchmarks/RESULTS.md), so the dense SwiGLU (the dense FFN and the shared expert) uses them too, through
`linear`: every feed-forward product then runs on the same code, and the MoE-vs-dense comparison
measures routing, not kernels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
from torch.autograd.function import once_differentiable

SOURCE = Path(__file__).parent / "csrc" / "grouped.cpp"

_module: ModuleType | None = None
_tried = False
_bf16: tuple[ModuleType, bool] | None = None  # bf16_available()'s answer, for the module it asked
_lock = threading.Lock()  # a second thread waits for the first one's build instead of seeing None


def _flags(stem: str = "grouped") -> tuple[str, list[str]]:
    """A name and compiler flags for the CPU's vector width; the name keeps builds for different CPUs apart."""
    capability = torch.backends.cpu.get_cpu_capability()
    march = {"AVX512": ["-march=x86-64-v4"], "AVX2": ["-march=x86-64-v3"]}.get(capability, [])
    return f"nanollama4_{stem}_{capability.lower()}", ["-O3", "-fopenmp", *march]


def load() -> ModuleType | None:
    """The compiled module, building it on the first call; None when it cannot be built (warned once)."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if not _tried:
            _module = _build()
            _tried = True
    return _module


def _build() -> ModuleType | None:
    """Compile the kernel (or import an earlier process's build); None, with a warning, when that fails."""
    return compile_source(SOURCE, "grouped", "the CPU expert kernels", "MoE layers use torch's grouped_mm instead "
                          "(slower with many experts)")


def compile_source(source: Path, stem: str, what: str, instead: str) -> ModuleType | None:
    """Compile one C++ file of csrc/ as a module (or import an earlier process's build); None, with a warning
    saying what happens `instead`, when that fails or NANOLLAMA4_CPU_KERNELS=0.

    A build is named by a hash of the source, csrc/'s headers, the flags and the torch and Python versions,
    and an existing build is imported directly, without asking ninja: two ninja binaries (the venv's, the
    system's) read each other's build logs as stale, so leaving the decision to whichever is on PATH rebuilt
    the kernel whenever PATH changed. A build that does run always says so, and always uses the same ninja.
    """
    if os.environ.get("NANOLLAMA4_CPU_KERNELS", "1") == "0":
        return None
    try:
        name, cflags = build_name(source, stem)
        build_dir = build_root() / name
        library = build_dir / f"{name}.so"
        if library.exists() and not (build_dir / "lock").exists():  # torch holds `lock` while it builds
            return _import(name, library)
        from torch.utils import cpp_extension  # (80 ms to import: only for a build)

        print(f"nanollama4: compiling {what} (once, about 20 s)...", file=sys.stderr, flush=True)
        build_dir.mkdir(parents=True, exist_ok=True)
        with _ninja_first_on_path():
            # -fopenmp links libgomp by name; torch's Linux wheels ship that same library, so the kernel's
            # threads are torch's threads (and follow torch.set_num_threads).
            return cpp_extension.load(name, [str(source)], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                                      build_directory=str(build_dir))
    except Exception as err:  # no compiler, no ninja, a read-only cache: fall back, but say so
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        warnings.warn(f"nanollama4: could not compile {what} ({first_line}); {instead}", RuntimeWarning,
                      stacklevel=4)
        return None


def build_name(source: Path | None = None, stem: str = "grouped") -> tuple[str, list[str]]:
    """The build's name (CPU vector width + a hash of everything that changes the binary) and its flags."""
    stem, cflags = _flags(stem)
    source = source or SOURCE
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the sources include
    key = hashlib.sha256(source.read_bytes() + headers + repr((cflags, torch.__version__, sys.version)).encode())
    return f"{stem}_{key.hexdigest()[:12]}", cflags


def build_root() -> Path:
    """Where builds go: $TORCH_EXTENSIONS_DIR, else torch's per-user cache folder (torch_extensions), found as
    `cpp_extension.get_default_build_root` finds it without importing that module (80 ms) when no build runs."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    try:
        return Path(os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions")))
    except AttributeError:  # a torch that moved it
        from torch.utils.cpp_extension import get_default_build_root

        return Path(get_default_build_root())


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def _ninja_first_on_path() -> Iterator[None]:
    """PATH with the `ninja` wheel's binary (a dependency, so always there) first, for the build only."""
    import ninja

    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def available() -> bool:
    """Whether the compiled kernel can be used (building it if needed)."""
    return load() is not None


def fp32_pays() -> bool:
    """Whether the float32 products are worth choosing here: built, on a CPU with AVX-512. Their loops are
    written for 16-float vectors; compiled for AVX2 they ran 15x slower than torch's matmul on a Zen 3
    (measured 2026-12-02, see git history of benchmarks/RESULTS.md), so `auto` leaves them to AVX-512 CPUs.
    NANOLLAMA4_CPU_KERNELS=force chooses them on any CPU (for tests and measurements)."""
    if not available():
        return False
    return os.environ.get("NANOLLAMA4_CPU_KERNELS") == "force" or torch.backends.cpu.get_cpu_capability() == "AVX512"


def require() -> None:
    """Raise unless `available()`: callers check that before choosing the kernel."""
    if not available():
        raise RuntimeError("the CPU expert kernels are not available; check nanollama4.ops.kernels.available() first")


def bf16_available() -> bool:
    """Whether the kernel's bf16 products can run here: built, on an x86 CPU with AVX512_BF16."""
    global _bf16
    built = load()
    if built is None:
        return False
    if _bf16 is None or _bf16[0] is not built:  # asked once per loaded module
        _bf16 = (built, bool(built.bf16_supported()))
    return _bf16[1]


def require_bf16() -> None:
    """Raise unless `bf16_available()`."""
    if not bf16_available():
        raise RuntimeError("the CPU kernels' bf16 products need AVX512_BF16; check "
                           "nanollama4.ops.kernels.bf16_available() first")


def module() -> ModuleType:
    """The compiled module's products (forward, input_grad, weight_grad; with AVX512_BF16 also forward_bf16,
    input_grad_bf16, weight_grad_bf16, and the activation swiglu, swiglu_grad), after `require()`."""
    if _module is None:
        raise RuntimeError("the CPU expert kernels are not loaded; call nanollama4.ops.kernels.require() first")
    return _module


class Linear(torch.autograd.Function):
    """x @ w.T for an (out, in) weight, as nn.Linear computes it: the grouped kernel with one group."""

    @staticmethod
    def forward(ctx, x_AK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        x_AK, w_1NK = x_AK.contiguous(), w_NK.contiguous()[None]
        counts = torch.tensor([x_AK.shape[0]])
        ctx.save_for_backward(x_AK, w_1NK, counts)
        return _module.input_grad(x_AK, w_1NK, counts)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_AN: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x_AK, w_1NK, counts = ctx.saved_tensors
        dy_AN = dy_AN.contiguous()
        dx = _module.forward(dy_AN, w_1NK, counts) if ctx.needs_input_grad[0] else None
        dw = _module.weight_grad(dy_AN, x_AK, counts)[0] if ctx.needs_input_grad[1] else None
        return dx, dw


def linear(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) without bias, through our kernel (see `linear_pays`). Needs `available()`."""
    require()
    return Linear.apply(x.reshape(-1, x.shape[-1]), w_NK).view(*x.shape[:-1], w_NK.shape[0])


def linear_pays(x: torch.Tensor) -> bool:
    """Whether `linear` is the faster way for x: float32 on the CPU outside autocast and compilation, with
    enough rows (a single decoding row has its own two-core path, `ops.linear.row_matmul`)."""
    return (not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and x.numel() >= 8 * x.shape[-1] and fp32_pays())
