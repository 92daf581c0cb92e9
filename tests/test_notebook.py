"""docs/notebooks/build_llama4.ipynb runs top to bottom: every from-scratch piece equals the package's."""

from __future__ import annotations

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
    page = nb.cells[-1].outputs[0]["data"]["text/html"]  # the Trace, shown as explain's page
    assert page.startswith("<iframe srcdoc=") and "nanollama4 explain" in page
