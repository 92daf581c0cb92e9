"""benchmarks/gpu.py's dry run on the CPU (`--device cpu --quick`): every section of the GPU check runs on tiny
shapes, so a CUDA machine's one try at it does not fail on a broken script. It shows the check runs, not
what a GPU measures (benchmarks/RESULTS.md, "On a GPU")."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

GPU_CHECK = Path(__file__).parent.parent / "benchmarks" / "gpu.py"


def test_the_gpu_check_runs_on_the_cpu(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(GPU_CHECK), "--device", "cpu", "--quick"])
    runpy.run_path(str(GPU_CHECK), run_name="__main__")
    out = capsys.readouterr().out
    for section in ("## 1.", "## 2.", "## 3.", "## 4. the gpu preset", "## 5. greedy decode"):
        assert section in out, section
    assert "| MoE | 1.0M | 0.3M | eager |" in out and "| dense twin | 0.3M | 0.3M | eager |" in out
    assert "| MoE | 1.0M | 0.3M | eager, whole-sequence masks |" in out
    assert "compiled modes skipped off CUDA" in out and "failed" not in out
