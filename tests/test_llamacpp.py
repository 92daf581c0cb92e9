"""`export --format gguf`: the file llama.cpp reads holds our model exactly, and a model llama.cpp would compute
differently is refused with each difference named. Where llama.cpp's tools are built
(benchmarks/llama_cpp_build.sh, or LLAMA_CPP_BIN), they run on the export and must agree with us."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanollama4.base.config import TrainConfig, preset
from nanollama4.base.errors import CheckpointError, ConfigError
from nanollama4.interop.checkpoint import load_run
from nanollama4.interop.llamacpp import GGUF_TYPES, check_llamacpp, export_gguf, gguf_tensors, llamacpp_differences
from nanollama4.model.tokenizer import BPETokenizer, CharTokenizer
from nanollama4.ops import build_model
from nanollama4.training.train import train
from tests.helpers import assert_cli_error, run_cli

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# The tiny preset as llama.cpp computes it: no chunk inside the context, no temperature inside it.
EXACT = dict(attention_chunk_size=None, floor_scale=8192)


def tiny_run(root: Path, corpus: Path, name: str, **tc) -> Path:
    run = root / name
    cfg = TrainConfig(**{**dict(seq_len=32, batch_size=4, eval_batches=2, eval_interval=100, warmup_steps=2,
                                max_steps=4, lr=3e-3, threads=1), **tc})
    train(preset("tiny", **EXACT), cfg, run, data=str(corpus), progress=False)
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-runs")
    return {"char": tiny_run(root, corpus, "char"), "bpe": tiny_run(root, corpus, "bpe", tokenizer="bpe",
                                                                      bpe_vocab_size=300)}


def read_back(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    reader = gguf.GGUFReader(path)
    fields = {name: f.contents() for name, f in reader.fields.items()}
    tensors = {t.name: torch.from_numpy(t.data.copy()).reshape([int(n) for n in reversed(t.shape)])
               for t in reader.tensors}
    return fields, tensors


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_the_gguf_holds_the_model_and_its_tokenizer(kind, runs, tmp_path, capsys):
    out = tmp_path / "model.gguf"
    rc, stdout, err = run_cli(["export", str(runs[kind]), str(out), "--format", "gguf"], capsys)
    assert rc == 0, err
    assert "llama4" in stdout
    model, tokenizer, _ = load_run(runs[kind])
    cfg = model.cfg
    fields, tensors = read_back(out)
    assert fields["general.architecture"] == "llama4"
    expect = {"llama4.block_count": cfg.n_layers, "llama4.embedding_length": cfg.d_model,
              "llama4.attention.head_count": cfg.n_heads, "llama4.attention.head_count_kv": cfg.n_kv_heads,
              "llama4.attention.key_length": cfg.head_dim, "llama4.rope.dimension_count": cfg.head_dim,
              "llama4.expert_count": cfg.n_experts, "llama4.expert_used_count": cfg.experts_per_token,
              "llama4.context_length": cfg.max_seq_len, "llama4.interleave_moe_layer_step": cfg.moe_every,
              "llama4.feed_forward_length": cfg.ffn_dim, "tokenizer.ggml.model": "gpt2",
              "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.add_bos_token": False}
    assert {k: fields[k] for k in expect} == expect
    assert fields["llama4.rope.freq_base"] == pytest.approx(cfg.rope_theta)
    assert fields["llama4.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.norm_eps)
    assert fields["llama4.attention.sliding_window_pattern"] == [True, True, True, False]  # the RoPE layers
    assert len(fields["tokenizer.ggml.tokens"]) == cfg.vocab_size
    assert fields["tokenizer.ggml.merges"]
    # every tensor, bit for bit, under llama.cpp's names and shapes
    ours = gguf_tensors(model)
    assert set(tensors) == set(ours)
    for name, t in ours.items():
        assert torch.equal(tensors[name], t), name
    e = cfg.n_experts
    assert tensors["blk.0.ffn_gate_exps.weight"].shape == (e, cfg.expert_dim, cfg.d_model)
    assert tensors["blk.0.ffn_down_exps.weight"].shape == (e, cfg.d_model, cfg.expert_dim)
    gate_up = model.blocks[0].ffn.experts.gate_up.detach()  # (E, D, 2H): gate then up
    assert torch.equal(tensors["blk.0.ffn_gate_exps.weight"], gate_up[..., :cfg.expert_dim].transpose(1, 2))
    assert torch.equal(tensors["blk.0.ffn_up_exps.weight"], gate_up[..., cfg.expert_dim:].transpose(1, 2))
    # the tokens are ours, spelled as byte-level BPE spells them
    if kind == "char":
        assert isinstance(tokenizer, CharTokenizer)
        assert fields["tokenizer.ggml.tokens"][tokenizer.stoi[" "]] == "Ġ"
        assert fields["tokenizer.ggml.tokens"][tokenizer.stoi["\n"]] == "Ċ"
    else:
        assert isinstance(tokenizer, BPETokenizer)
        tokens = fields["tokenizer.ggml.tokens"]
        assert "".join(tokens[i] for i in tokenizer.encode(" the king\n")) == "ĠtheĠkingĊ"


def test_a_character_of_several_bytes_is_rebuilt_by_its_own_merges():
    from nanollama4.interop.llamacpp import char_vocabulary

    tokens, merges = char_vocabulary(CharTokenizer(["a", "é", "€", " "]))
    assert tokens == ["a", "Ã©", "âĤ¬", "Ġ"]
    assert merges == ["Ã ©", "â Ĥ", "âĤ ¬"]
    tokens, merges = char_vocabulary(CharTokenizer(["a", "b"]))
    assert merges == ["aa a"]  # a merge that never applies: llama.cpp wants the list to exist


@pytest.mark.parametrize("change, named", [
    ({}, ["attention_chunk_size=8 on the RoPE layers", "temperature"]),  # the tiny preset itself
    ({**EXACT, "max_seq_len": 16384}, ["full attention on the RoPE layers", "max_seq_len <= 8192"]),
    ({**EXACT, "nope_interval": 2}, ["layers without RoPE [1, 3]", "nope_interval=4"]),
    ({**EXACT, "use_qk_norm": False}, ["use_qk_norm=false", "use_qk_norm=true"]),
    ({**EXACT, "router": "softmax"}, ["router='softmax'"]),
    ({**EXACT, "n_experts": 0}, ["dense model"]),
    ({**EXACT, "floor_scale": 16}, ["temperature", "floor_scale=8192"]),
])
def test_a_model_llama_cpp_would_compute_differently_is_refused_naming_each_difference(change, named):
    cfg = preset("tiny", **change)
    found = llamacpp_differences(cfg)
    assert found.differences
    text = "; ".join(found.differences)
    for words in named:
        assert words in text, (words, text)
    with pytest.raises(CheckpointError, match="llama.cpp would compute a different model"):
        check_llamacpp(build_model(cfg))


def test_differences_that_cannot_act_within_the_context_are_notes_not_refusals():
    cfg = preset("tiny", attention_chunk_size=64, floor_scale=128)  # both reach past max_seq_len = 64
    found = llamacpp_differences(cfg)
    assert found.differences == []
    assert any("attention_chunk_size=64" in n for n in found.notes)
    assert any("temperature is 1" in n for n in found.notes)
    assert llamacpp_differences(preset("tiny", attention_chunk_size=8192, floor_scale=8192)).notes == []


def test_the_cli_refuses_in_one_line_and_never_replaces_a_file(runs, tiny_run, tmp_path, capsys):
    out = tmp_path / "model.gguf"
    rc, _, err = run_cli(["export", str(tiny_run), str(out), "--format", "gguf"], capsys)
    line = assert_cli_error(rc, err, "export")
    assert "attention_chunk_size=8" in line and "floor_scale=8192" in line
    assert not out.exists() and list(tmp_path.iterdir()) == []
    out.write_text("mine")
    rc, _, err = run_cli(["export", str(runs["char"]), str(out), "--format", "gguf"], capsys)
    assert "exists" in assert_cli_error(rc, err, "export")
    assert out.read_text() == "mine"
    link = tmp_path / "link.gguf"
    link.symlink_to(tmp_path / "elsewhere.gguf")
    rc, _, err = run_cli(["export", str(runs["char"]), str(link), "--format", "gguf"], capsys)
    assert_cli_error(rc, err, "export")
    assert not (tmp_path / "elsewhere.gguf").exists()


# An export killed as it writes: the kernel's SIGKILL once the header is in the file (what an out-of-memory kill
# or `kill -9` does to a 620 MB export), so its cleanup never runs.
KILLED_EXPORT = """
import os, signal, sys
import gguf
from nanollama4.interop.checkpoint import load_run
from nanollama4.interop.llamacpp import export_gguf

def killed(self, *args, **kwargs):
    written(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)

written, gguf.GGUFWriter.write_kv_data_to_file = gguf.GGUFWriter.write_kv_data_to_file, killed
model, tokenizer, _ = load_run(sys.argv[1])
export_gguf(model, tokenizer, sys.argv[2])
"""


def dead_pid() -> int:
    """The pid of a process that has ended (not reused in the moment a test takes)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_exports_temporary_file_is_removed_by_the_next_export(runs, tmp_path, capsys):
    """It stayed for good (a hidden .NAME.gguf.tmp-* of the model's size) and nothing ever removed it."""
    out = tmp_path / "model.gguf"
    done = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(runs["char"]), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == -9, done.stderr
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".model.gguf.tmp-") and left.read_bytes()[:4] == b"GGUF" and not out.exists()
    rc, stdout, err = run_cli(["export", str(runs["char"]), str(out), "--format", "gguf"], capsys)
    assert rc == 0, err
    assert f"note: removed {left.name} (" in stdout and "the temporary file of an export that was killed" in stdout
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_only_a_dead_exports_own_temporary_file_is_removed(runs, tmp_path, capsys):
    """What is not certainly a killed export's file stays: a live export's (its pid alive, or its lock held,
    as by an export in another container whose pid means nothing here), a link, a file that is not GGUF, a
    name no export gives."""
    import fcntl

    folder = tmp_path / "exports"
    folder.mkdir()
    gone = dead_pid()
    header = b"GGUF" + bytes(20)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        keep = {f".a.gguf.tmp-{live.pid}-abcdefgh": header,  # its writer is running
                f".b.gguf.tmp-{gone}-abcdefgh": header,  # locked below: a writer elsewhere
                f".c.gguf.tmp-{gone}-abcdefgh": b"mine",  # not what an export writes
                f".d.gguf.tmp-{gone}-abcdefg": header,  # not a name an export gives
                ".e.gguf.tmp-abcdefgh": header}  # the name exports gave before their pid was in it
        for name, data in keep.items():
            (folder / name).write_bytes(data)
        (tmp_path / "elsewhere.gguf").write_bytes(header)
        (folder / f".f.gguf.tmp-{gone}-abcdefgh").symlink_to(tmp_path / "elsewhere.gguf")
        (folder / f".g.gguf.tmp-{gone}-abcdefgh").write_bytes(b"")  # killed before its first byte: removed
        (folder / f".h.gguf.tmp-{gone}-abcdefgh").write_bytes(header)  # removed
        with open(folder / f".b.gguf.tmp-{gone}-abcdefgh", "rb") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            rc, stdout, err = run_cli(["export", str(runs["char"]), str(folder / "new.gguf"), "--format", "gguf"],
                                      capsys)
        assert rc == 0, err
    finally:
        live.kill()
        live.wait()
    assert stdout.count("note: removed") == 2 and f".g.gguf.tmp-{gone}" in stdout and f".h.gguf.tmp-{gone}" in stdout
    assert sorted(p.name for p in folder.iterdir()) == sorted([*keep, f".f.gguf.tmp-{gone}-abcdefgh", "new.gguf"])
    assert all((folder / name).read_bytes() == data for name, data in keep.items())
    assert (folder / f".f.gguf.tmp-{gone}-abcdefgh").is_symlink() and (tmp_path / "elsewhere.gguf").exists()


def test_rope_scaling_travels_as_llama_cpp_frequency_factors(tmp_path):
    cfg = preset("tiny", **EXACT, rope_scaling=8.0, rope_original_max_len=64)
    model = build_model(cfg)
    factors = gguf_tensors(model)["rope_freqs.weight"]
    assert factors.shape == (cfg.head_dim // 2,)
    assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(8.0)  # short waves kept, long slowed
    export_gguf(model, CharTokenizer([chr(i) for i in range(32, 32 + cfg.vocab_size)]), tmp_path / "m.gguf")
    _, tensors = read_back(tmp_path / "m.gguf")
    assert torch.equal(tensors["rope_freqs.weight"], factors)


# ---------------------------------------------------------------------------------------------- llama.cpp


def llama_cpp_bin() -> Path | None:
    """Where llama.cpp's tools are: LLAMA_CPP_BIN, or benchmarks/llama_cpp_build.sh's default cache."""
    from benchmarks.llama_cpp import default_bin

    where = default_bin()
    return where if where is not None and (where / "llama-perplexity").exists() else None


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_llama_cpp_computes_our_model(kind, runs, corpus, tmp_path):
    """llama.cpp tokenizes the validation text as we do, its perplexity equals ours on the same windows to
    0.1%, and its greedy continuation is ours, token for token."""
    where = llama_cpp_bin()
    if where is None:
        pytest.skip("llama.cpp's tools are not built here: benchmarks/llama_cpp_build.sh builds them (about 4 minutes "
                    "on 2 cores, more than make test can spare, so CI does not)")
    from benchmarks.llama_cpp import compare

    row = compare(runs[kind], corpus, where, tmp_path, n_ctx=64, chunks=6, new_tokens=40)
    assert row["same_tokens"], row
    assert abs(row["ppl_llama_cpp"] / row["ppl_ours"] - 1) < 1e-3, row
    assert row["greedy_same"], row


def test_the_comparison_fits_a_short_context(runs, corpus, tmp_path):
    """Issue 72: llama_cpp.sh asked a run of a 64-token context for 16 + 200 tokens and crashed. The window
    and the greedy length are cut to the run's context, and the row says what was used."""
    where = llama_cpp_bin()
    if where is None:
        pytest.skip("llama.cpp's tools are not built here: benchmarks/llama_cpp_build.sh builds them")
    from benchmarks.llama_cpp import PROMPT, compare

    context = load_run(runs["char"])[0].cfg.max_seq_len
    row = compare(runs["char"], corpus, where, tmp_path, n_ctx=4 * context, chunks=3, new_tokens=10 * context)
    assert row["ctx"] == context and row["new_tokens"] == context - min(PROMPT, context // 4)
    assert abs(row["ppl_llama_cpp"] / row["ppl_ours"] - 1) < 1e-3 and row["greedy_same"], row


@pytest.mark.parametrize("weights", ["f16", "bf16", "q8_0"])
def test_the_weight_matrices_go_in_the_type_asked_and_the_vectors_stay_float32(weights, runs, corpus, tmp_path):
    """`export_gguf(weights=...)`: every matrix in the type asked, holding the float32 export's values to that
    type's rounding (Q8_0: a scale per 32 values, within ~half a step, the block's largest / 127); the
    norms stay float32, as llama.cpp's own converter writes them. Where llama.cpp's tools are built, its
    perplexity on the file is within 1% of its perplexity on the float32 file."""
    model, tokenizer, _ = load_run(runs["char"])
    exact, typed = tmp_path / "f32.gguf", tmp_path / f"{weights}.gguf"
    export_gguf(model, tokenizer, exact)
    export_gguf(model, tokenizer, typed, weights=weights)
    want = gguf.GGMLQuantizationType[weights.upper()]
    reference = {t.name: t for t in gguf.GGUFReader(exact).tensors}
    matrices = 0
    for t in gguf.GGUFReader(typed).tensors:
        values = torch.from_numpy(reference[t.name].data.copy()).flatten()
        if len(t.shape) < 2:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
            continue
        matrices += 1
        assert t.tensor_type == want, t.name
        back = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).flatten()
        if weights == "q8_0":  # half a step of amax / 127, and the step itself stored as float16 (127 * 2^-11)
            bound = (values.view(-1, 32).abs().amax(1, keepdim=True) / 127 * 0.57).expand(-1, 32).flatten()
        else:  # half a unit in the last place: 2^-11 relative in float16 (2^-25 below its normals), 2^-8 in bf16
            bound = values.abs() * 2.0 ** -11 + 2.0 ** -25 if weights == "f16" else values.abs() * 2.0 ** -8
        assert ((back - values).abs() <= bound).all(), t.name
    assert matrices >= 4 * model.cfg.n_layers
    with pytest.raises(ConfigError, match="unknown GGUF weight type 'q4_k'; choose one of " + ", ".join(GGUF_TYPES)):
        export_gguf(model, tokenizer, tmp_path / "no.gguf", weights="q4_k")
    where = llama_cpp_bin()
    if where is None:
        pytest.skip("llama.cpp's tools are not built here: the file's perplexity in llama.cpp was not measured")
    from benchmarks.llama_cpp import _tool

    def perplexity(path: Path) -> float:
        out = _tool(where, "llama-perplexity", "-m", str(path), "-f", str(corpus), "-c", "64", "-b", "64",
                    "--chunks", "4", "-t", "1", whole=lambda out: "Final estimate" in out or "[4]" in out)
        import re

        return float(re.findall(r"\[(\d+)\]([\d.]+),", out)[-1][1])

    assert abs(perplexity(typed) / perplexity(exact) - 1) < 1e-2


def test_export_outtype_writes_the_type_and_says_so(runs, tmp_path, capsys):
    """`export --format gguf --outtype q4_0`: the matrices in Q4_0, the line saying so; a transformers export
    refuses an --outtype (it holds the run's float32 weights)."""
    out = tmp_path / "q4.gguf"
    rc, printed, err = run_cli(["export", str(runs["char"]), str(out), "--format", "gguf", "--outtype", "q4_0"], capsys)
    assert rc == 0, err
    assert "its matrices in Q4_0" in printed
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q4_0
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    rc, _, err = run_cli(["export", str(runs["char"]), str(tmp_path / "hf"), "--outtype", "q8_0"], capsys)
    assert "--outtype is for --format gguf" in assert_cli_error(rc, err, "export")


def test_approximate_exports_what_llama_cpp_computes_and_says_what_it_costs(corpus, tmp_path, capsys):
    """Issue 72: the demo's run (chunks of 64, a temperature floor of 64, balancing biases) did not export.
    `--approximate` writes the model llama.cpp computes from the same weights (full attention within the
    context, its temperature, no bias), after printing each change and the validation loss before and after;
    the printed "after" is that model's loss, computed here on its own; the GGUF holds the weights as they are."""
    from nanollama4.commands.export import DROP_BIAS_TOKENS
    from nanollama4.interop.llamacpp import nearest_llamacpp
    from nanollama4.training.evaluation import full_validation_loss, validation_of_run

    run = tmp_path / "chunked"
    tc = TrainConfig(seq_len=32, batch_size=4, eval_batches=2, eval_interval=100, warmup_steps=2, max_steps=6, lr=3e-3,
                     threads=1)
    train(preset("tiny", bias_balance_rate=0.05), tc, run, data=str(corpus), progress=False)
    out = tmp_path / "near.gguf"
    rc, printed, err = run_cli(["export", str(run), str(out), "--format", "gguf", "--approximate"], capsys)
    assert rc == 0, err
    assert "chunks of 8 become llama.cpp's full attention within the context of 64" in printed
    assert "temperature (floor 4, scale 0.1) becomes llama.cpp's (floor 8192, scale 0.1, 1 throughout" in printed
    assert "balancing biases are dropped" in printed
    found = re.search(r"Validation loss (\d+\.\d{4}) as trained, (\d+\.\d{4}) as llama.cpp computes it "
                      r"\(([-+]\d+\.\d{4}) nats/token", printed)
    assert found, printed
    trained = validation_of_run(run, max_tokens=DROP_BIAS_TOKENS)
    cfg, _ = nearest_llamacpp(trained.model.cfg)
    assert llamacpp_differences(cfg).differences == []
    near = build_model(cfg)
    near.load_state_dict(trained.model.state_dict())
    for moe in near.moe_layers():
        moe.router.expert_bias.data.zero_()
    theirs = full_validation_loss(near, trained.tokens, trained.window, torch.device("cpu"))
    assert float(found[2]) == pytest.approx(theirs, abs=1e-4) and float(found[1]) != float(found[2])
    _, tensors = read_back(out)
    assert torch.equal(tensors["blk.0.attn_q.weight"], gguf_tensors(near)["blk.0.attn_q.weight"])
