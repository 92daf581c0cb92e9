"""The compiled CPU grouped product (nanollama4.ops.kernels) against plain float64 products, with gradients.

It must build here: the test command installs everything, so a missing compiler or ninja is a failure,
not a silent fallback to the slower grouped_mm.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd.function import once_differentiable
from torch.utils import cpp_extension

from nanollama4 import ops
from nanollama4.base.config import ModelConfig
from nanollama4.model.moe import MoE, SwiGLU
from nanollama4.ops import kernels

HYP = settings(deadline=None, derandomize=True, database=None, max_examples=60)


class GroupedMatmul(torch.autograd.Function):
    """The kernel's three products as one autograd function, y_g = x_g @ w_g over consecutive row groups
    (counts_G rows each), so that each product can be checked alone; the package uses them in SwiGLU
    (`ops.experts.kernel_product`) and in `kernels.linear`."""

    @staticmethod
    def forward(ctx, x_AK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
        x_AK, w_GKN = x_AK.contiguous(), w_GKN.contiguous()
        ctx.save_for_backward(x_AK, w_GKN, counts_G)
        return kernels.module().forward(x_AK, w_GKN, counts_G)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_AN: torch.Tensor):
        x_AK, w_GKN, counts_G = ctx.saved_tensors
        dy_AN, k = dy_AN.contiguous(), kernels.module()
        dx = k.input_grad(dy_AN, w_GKN, counts_G) if ctx.needs_input_grad[0] else None
        dw = k.weight_grad(x_AK, dy_AN, counts_G) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_matmul(x_AK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    kernels.require()
    return GroupedMatmul.apply(x_AK, w_GKN, counts_G)


def test_the_kernel_builds():
    assert kernels.available(), "the CPU expert kernels did not compile: see the warning above"


def check(counts: list[int], K: int, N: int, seed: int) -> None:
    """y, dx and dw of the kernel against per-group float64 products, for a random cotangent."""
    g = torch.Generator().manual_seed(seed)
    counts_G = torch.tensor(counts, dtype=torch.long)
    A, G = sum(counts), len(counts)
    x = torch.randn(A, K, generator=g).requires_grad_()
    w = torch.randn(G, K, N, generator=g).requires_grad_()
    y = grouped_matmul(x, w, counts_G)
    dy = torch.randn(A, N, generator=g)
    y.backward(dy)
    xs, dys, w64 = x.detach().double().split(counts), dy.double().split(counts), w.detach().double()
    want_y = torch.cat([xs[i] @ w64[i] for i in range(G)])
    want_dx = torch.cat([dys[i] @ w64[i].T for i in range(G)])
    want_dw = torch.stack([xs[i].T @ dys[i] for i in range(G)])  # zero for a group without rows
    # float32 sums of K (forward), N (input gradient) or up to 30 rows (weight gradient) products of O(1) terms
    tol = dict(atol=1e-5 * max(K, N) ** 0.5 * 4, rtol=1e-5)
    torch.testing.assert_close(y.double(), want_y, **tol)
    torch.testing.assert_close(x.grad.double(), want_dx, **tol)
    torch.testing.assert_close(w.grad.double(), want_dw, **tol)


@HYP
@given(counts=st.lists(st.integers(0, 30), min_size=1, max_size=9), K=st.integers(1, 100), N=st.integers(1, 140),
       seed=st.integers(0, 2**16))
def test_matches_plain_products(counts, K, N, seed):
    """Any widths (the vector tails, and the input gradient's panels of 64 and of 16-48 rows of w and the
    rows after them), empty groups (zero weight gradient), groups across tile sizes."""
    check(counts, K, N, seed)


@pytest.mark.parametrize(("K", "N"), [(21, 2048), (21, 2049), (70, 2100)])
def test_rows_too_wide_for_a_panel_take_dot_products(K, N):
    """The input gradient transposes w (K x N) into panels for N up to 2,048 and sums dot products beyond."""
    check([5, 0, 13], K, N, seed=2)


@pytest.mark.parametrize("threads", [1, 3, 16])
@pytest.mark.parametrize(("counts", "K", "N"), [([700], 64, 96), ([500, 3, 0, 260], 37, 130), ([0, 0], 16, 16)])
def test_large_groups_split_across_cores(counts, K, N, threads):
    """A group bigger than one core's share is cut into row slices (and weight-row slices for dw), for any
    number of threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(counts, K, N, seed=1)
    finally:
        torch.set_num_threads(before)


def test_gradients_refuse_a_second_backward():
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(2, 8, 16, requires_grad=True)
    y = grouped_matmul(x, w, torch.tensor([4, 2]))
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|marked with @once_differentiable"):
        gx.sum().backward()


def test_compiled_code_does_not_call_the_kernel():
    """A graph cannot trace into the extension: while compiling, SwiGLU takes torch's products."""
    torch._dynamo.reset()
    mlp = ops.install(SwiGLU(16, 32))
    x = torch.randn(24, 16)
    with mock.patch.object(kernels.Linear, "apply", wraps=kernels.Linear.apply) as spy:
        got = torch.compile(mlp, backend="eager", fullgraph=True)(x)
    assert not spy.called
    torch.testing.assert_close(got, mlp(x), atol=1e-5, rtol=1e-5)


def test_bad_counts_are_rejected_with_a_message():
    x, w = torch.randn(5, 4), torch.randn(2, 4, 16)
    with pytest.raises(RuntimeError, match="add up to the number of rows"):
        grouped_matmul(x, w, torch.tensor([2, 2]))
    with pytest.raises(RuntimeError, match="must not be negative"):
        grouped_matmul(x, w, torch.tensor([6, -1]))


def test_a_failed_build_warns_once_and_moe_falls_back_to_grouped_mm(monkeypatch, tmp_path):
    """No compiler (or any build error): one warning naming the fallback, and auto dispatch still works."""

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'nanollama4_grouped': c++: not found\nmore detail")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no earlier build to import
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.warns(RuntimeWarning, match=r"could not compile .*c\+\+: not found.*grouped_mm instead"):
        assert not kernels.available()
    assert not kernels.available()  # decided once: no second warning, no second build
    with pytest.raises(RuntimeError, match="not available"):
        grouped_matmul(torch.randn(2, 4), torch.randn(1, 4, 16), torch.tensor([2]))
    moe = ops.install(MoE(ModelConfig(d_model=16, n_experts=4, experts_per_token=1, expert_dim=16, n_heads=2,
                                      n_kv_heads=1, head_dim=8)))
    with mock.patch.object(F, "grouped_mm", wraps=F.grouped_mm) as spy:
        moe(torch.randn(1, 12, 16)).sum().backward()
    assert spy.called


def test_a_build_is_keyed_by_source_and_flags_and_always_announced(monkeypatch, tmp_path, capsys):
    """Every build prints the notice (it used to be skipped whenever some .so existed, so a rebuild was
    silent), gets its own folder per source and flags, and runs with the venv's ninja first on PATH."""
    import ninja

    calls = []

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory):
        calls.append((name, build_directory, os.environ["PATH"].split(os.pathsep)[0]))
        return "module"

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    path_before = os.environ["PATH"]
    assert kernels._build() == "module"
    assert "compiling the CPU expert kernels" in capsys.readouterr().err
    name, build_dir, first_on_path = calls[0]
    assert name == kernels.build_name()[0] and Path(build_dir) == tmp_path / name
    assert first_on_path == ninja.BIN_DIR and os.environ["PATH"] == path_before  # for the build only

    (tmp_path / name / f"{name}.so").write_bytes(b"")  # a stale or other-version build beside a new source
    edited = tmp_path / "grouped.cpp"
    edited.write_text(kernels.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(kernels, "SOURCE", edited)
    assert kernels._build() == "module"
    assert "compiling" in capsys.readouterr().err
    assert calls[1][0] != name and calls[1][0].startswith(name.rsplit("_", 1)[0])


def test_an_existing_build_loads_without_running_any_ninja(tmp_path):
    """Whichever ninja is first on PATH (it used to rebuild for 25 s when the venv's and the system's
    alternated), a build that exists is imported as it is: a `ninja` that fails loudly is never called."""
    assert kernels.available()  # this process built or imported it
    name = kernels.build_name()[0]
    library = kernels.build_root() / name / f"{name}.so"
    before = library.stat().st_mtime_ns
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "ninja").write_text("#!/bin/sh\necho ninja was called >&2\nexit 1\n")
    (fake_bin / "ninja").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"}
    code = "import nanollama4.ops.kernels as k, sys; sys.exit(0 if k.available() else 1)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "compiling" not in proc.stderr and "ninja was called" not in proc.stderr, proc.stderr
    assert library.stat().st_mtime_ns == before


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setenv("NANOLLAMA4_CPU_KERNELS", "0")
    assert not kernels.available()



@pytest.mark.parametrize(("rows", "d", "hidden"), [(8, 16, 40), (300, 64, 96), (9, 7, 5)])
def test_swiglu_on_the_kernel_matches_torch_linear(rows, d, hidden):
    """The dense FFN / shared expert in float32 on the CPU runs on the kernel; same outputs and gradients."""
    torch.manual_seed(0)
    mlp = ops.install(SwiGLU(d, hidden))
    x = torch.randn(2, rows, d, requires_grad=True)
    cot = torch.randn(2, rows, d)

    def run(use_kernel: bool):
        x.grad = None
        mlp.zero_grad()
        with mock.patch.object(kernels, "linear_pays", return_value=use_kernel), \
                mock.patch.object(kernels.Linear, "apply", wraps=kernels.Linear.apply) as spy:
            y = mlp(x)
        (y * cot).sum().backward()
        assert spy.called == use_kernel
        return y.detach(), x.grad.clone(), [p.grad.clone() for p in mlp.parameters()]

    y, gx, gp = run(True)
    y_ref, gx_ref, gp_ref = run(False)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, gx_ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(gp, gp_ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_linear_pays_only_for_float32_cpu_outside_autocast(monkeypatch):
    x = torch.randn(16, 8)
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert kernels.linear_pays(x) == avx512  # auto: the float32 loops pay only with AVX-512
    monkeypatch.setenv("NANOLLAMA4_CPU_KERNELS", "force")
    assert kernels.linear_pays(x)
    assert not kernels.linear_pays(x[:1])  # one decoding row keeps its own path
    assert not kernels.linear_pays(x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not kernels.linear_pays(x)
