"""docs/notebooks/build_llama4.ipynb runs top to bottom: every from-scratch piece equals the package's."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[1] / "docs" / "notebooks" / "build_llama4.ipynb"


def test_the_build_llama4_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOLLAMA4_CACHE", str(tmp_path / "cache"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = ["".join(o.get("text", "") for o in cell.get("outputs", [])) for cell in nb.cells
               if cell.cell_type == "code"]
    text = "\n".join(outputs)
    for line in ("RMSNorm matches", "RoPE matches", "layer 0: RoPE, chunk 8 matches", "layer 3: NoPE matches",
                 "SwiGLU matches", "the router matches", "the MoE layer matches a token-by-token loop",
                 "every block and the model's logits match", "validation loss after 60 steps"):
        assert line in text, line
    assert "Llama 4's MoE (sigmoid score on the input) matches" in text
    # the capacity cell: computed capacities, tokens passed on to a next-best expert, and dropped ones
    counts = re.findall(r"capacity factor ([\d.]+): ⌈[\d.]+ · 12 tokens · top-2 / 4 experts⌉ = (\d+) slots per "
                        r"expert; (\d+) slots? rerouted to a next-best expert, (\d+) dropped", text)
    assert [(cf, int(cap)) for cf, cap, _, _ in counts] == [("1.0", 6), ("0.5", 3)]
    assert int(counts[0][2]) >= 1 and int(counts[1][3]) >= 1
    streams = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in streams if o.get("name") == "stderr"]  # no warning in any output
    assert "Warning" not in text
    page = nb.cells[-1].outputs[0]["data"]["text/html"]  # the Trace, shown as explain's page
    assert page.startswith("<iframe srcdoc=") and "nanollama4 explain" in page
