"""`nanollama4 experts`: the counts against the router's own choices (with capacity drops), lift and mutual
information against hand computations, the shuffle null's loads, windows over a long text, --json, and
bad input in one line."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from nanollama4.base.config import preset
from nanollama4.base.errors import ConfigError
from nanollama4.engine.observe import observe
from nanollama4.model.tokenizer import CharTokenizer
from nanollama4.model.transformer import Transformer
from nanollama4.reports.experts import TOKEN_CLASSES, analyse, experts, token_classes, training_routing, untrained_twin
from nanollama4.reports.expertsview import report_dict
from nanollama4.reports.routes import Routes, route_stream
from nanollama4.reports.specialise import (
    joint_counts,
    kl_per_row,
    lift,
    mutual_information,
    mutual_information_of,
    shuffled,
    specialisation,
)

from .helpers import assert_cli_error, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "The cat sat on the mat.\nA dog ran to 42 houses!\n" * 8 + "The end."  # 392 characters: capitals, digits


@pytest.fixture(scope="module")
def crowded() -> tuple[Transformer, CharTokenizer]:
    """A tiny char model whose experts are too few for their tokens in eval: capacity 0.5 with drop, so that
    slots are dropped, and random weights so that routing is uneven."""
    torch.manual_seed(0)
    tok = CharTokenizer.from_text(TEXT)
    cfg = preset("tiny", vocab_size=tok.vocab_size, capacity_factor=0.5, capacity_in_eval=True,
                 capacity_overflow="drop", max_seq_len=32)
    return Transformer(cfg).eval(), tok


def test_counts_equal_the_routers_own_choices_with_drops(crowded):
    model, tok = crowded
    ids = np.array(tok.encode(TEXT))
    report = experts(model, tok, ids, batch=3, min_support=1)
    # independently: the same windows, three per forward, each MoE's Routing read directly
    W, E, V = 32, model.cfg.n_experts, model.cfg.vocab_size
    want = {m: np.zeros((E, V), dtype=np.int64) for m in model.moe_layers()}
    dropped = dict.fromkeys(model.moe_layers(), 0)
    starts = list(range(0, len(ids) - W + 1, W))
    groups = [starts[i:i + 3] for i in range(0, len(starts), 3)] + [[len(starts) * W]]  # and the last 8 tokens
    with torch.no_grad(), observe(model) as seen:
        for g in groups:
            span = min(W, len(ids) - g[0])
            x = torch.tensor(np.stack([ids[s:s + span] for s in g]))
            model(x)
            for m in model.moe_layers():
                r = seen["routing"][m]
                flat = x.reshape(-1)
                for t, (row, ok) in enumerate(zip(r.experts_TK.tolist(), r.valid_TK.tolist(), strict=True)):
                    for e, v in zip(row, ok, strict=True):
                        if v:
                            want[m][e, flat[t]] += 1
                        else:
                            dropped[m] += 1
    for layer, m in zip(report.layers, model.moe_layers(), strict=True):
        got = np.zeros((E, V), dtype=np.int64)
        for e, v, n in layer.assignments:
            got[e, v] = n
        assert (got == want[m]).all()
        assert layer.dropped == dropped[m] > 0  # capacity really dropped slots
        assert [x.assignments for x in layer.experts] == want[m].sum(1).tolist()
        assert sum(n for _, n in layer.dropped_by_token) == dropped[m]


def test_a_long_text_is_read_whole_in_windows(crowded):
    model, tok = crowded
    ids = np.array(tok.encode(TEXT))  # 392 tokens: 12 windows of 32 and one of 8
    routes = route_stream(model, ids, batch=5, quiet=True)
    assert routes.windows == 13 and routes.experts_LNK.shape[1] == len(ids)
    report = analyse(routes, tok, model.cfg.vocab_size)
    K = model.cfg.experts_per_token
    for layer in report.layers:
        assert layer.tokens == len(ids)
        assert sum(n for *_, n in layer.assignments) + layer.dropped == len(ids) * K
    # the last, short window was routed too: its tokens have slots filled
    assert (routes.experts_LNK[:, -8:] >= 0).any()


def test_lift_and_mutual_information_by_hand():
    # 2 experts, 3 tokens: expert 0 takes token 0 four times and token 1 twice; expert 1 takes token 2 twice
    expert = np.array([0, 0, 0, 0, 0, 0, 1, 1])
    token = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    joint = joint_counts(expert, token, 2, 3)
    assert joint.tolist() == [[4, 2, 0], [0, 0, 2]]
    # P(token 0 | expert 0) = 4/6, P(token 0) = 4/8: lift 4/3; token 2 at expert 1: 1 / (2/8) = 4
    assert lift(joint)[0, 0] == pytest.approx(4 / 3)
    assert lift(joint)[1, 2] == pytest.approx(4.0)
    # I = H(expert) here (the token decides the expert): H(6/8, 2/8)
    h = -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))
    assert mutual_information(joint) == pytest.approx(h)
    # each expert's KL, weighted by its share, adds up to the MI
    assert (kl_per_row(joint) * joint.sum(1) / joint.sum()).sum() == pytest.approx(h)
    assert kl_per_row(joint)[1] == pytest.approx(math.log2(4))  # P(2|1) = 1 against P(2) = 1/4
    # the sparse count (for large tables) gives the same number
    from nanollama4.reports import specialise

    old, specialise.DENSE_CELLS = specialise.DENSE_CELLS, 0
    try:
        assert mutual_information_of(expert, token, 2, 3) == pytest.approx(h)
    finally:
        specialise.DENSE_CELLS = old
    # independent labels carry nothing
    assert mutual_information(np.array([[2, 2], [2, 2]])) == 0.0


def test_the_shuffle_null_keeps_every_experts_load():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 5, size=1000)
    for _ in range(3):
        again = shuffled(labels, rng)
        assert (np.bincount(again, minlength=5) == np.bincount(labels, minlength=5)).all()
        assert (again != labels).any()
    # a routing that follows the token sits far above its null; one independent of it does not
    token = rng.integers(0, 20, size=4000)
    s = specialisation(token % 5, token, 5, 20, [0, 1000, 2000, 3000, 4000])
    assert s.bits == pytest.approx(math.log2(5), abs=0.01) and s.null_bits < 0.05
    assert s.excess_low is not None and s.excess_low > 2
    s = specialisation(rng.integers(0, 5, size=4000), token, 5, 20, [0, 2000, 4000])
    assert abs(s.excess_mean) < 0.05


def test_token_classes_are_declared_once_and_extendable(monkeypatch):
    tok = CharTokenizer.from_text("aZ3 \n.é")
    names, class_V = token_classes(tok, tok.vocab_size)
    got = {tok.decode([v]): names[c] for v, c in enumerate(class_V)}
    assert got == {"a": "lowercase", "Z": "uppercase", "3": "digit", " ": "space", "\n": "newline",
                   ".": "punctuation", "é": "lowercase"}
    monkeypatch.setitem(TOKEN_CLASSES, "char", {"vowel": lambda s: s in "aeioué", **TOKEN_CLASSES["char"]})
    names, class_V = token_classes(tok, tok.vocab_size)
    assert names[class_V[tok.encode("é")[0]]] == "vowel" and names[-1] == "other"


def test_contexts_mark_the_token_where_it_went(crowded):
    model, tok = crowded
    report = experts(model, tok, np.array(tok.encode(TEXT)), min_support=1)
    stats = [t for layer in report.layers for e in layer.experts for t in e.top_count]
    assert stats
    for t in stats:
        assert 1 <= len(t.contexts) <= 3
        for c in t.contexts:
            assert c.count("⟦") == 1 and f"⟦{t.token}⟧" in c


def test_a_dense_model_has_no_experts_to_read():
    tok = CharTokenizer.from_text(TEXT)
    model = Transformer(preset("tiny", vocab_size=tok.vocab_size, n_experts=0))
    with pytest.raises(ConfigError, match="no MoE layer"):
        experts(model, tok, np.array(tok.encode(TEXT)))


def test_cli_on_a_run_and_json_round_trips(tiny_run, corpus, tmp_path, capsys):
    out = tmp_path / "experts.json"
    rc, stdout, err = run_cli(["experts", str(tiny_run), "--data", str(corpus), "--tokens", "500", "--batch", "2",
                               "--json", str(out), "--quiet"], capsys)
    assert rc == 0, err
    assert "layer 0:" in stdout and "I(expert; token)" in stdout and "paths:" in stdout
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["tokens"] == 500 and data["layers"][0]["tokens"] == 500
    # the same text routed in Python gives exactly what the file holds
    from nanollama4.interop.hf import load_any

    model, tok = load_any(tiny_run)
    ids = np.array(tok.encode(corpus.read_text()))[:500]
    again = experts(model, tok, ids, batch=2)
    again.source = f"{tiny_run}; {corpus}"
    again.training = training_routing(tiny_run)  # what the command adds for a run: its logged routing
    assert again.training is not None and "entropy" in again.training.values
    assert data == json.loads(json.dumps(report_dict(again)))
    assert data["format"] == "nanollama4-experts/2" and set(dataclasses.asdict(
        experts(model, tok, ids[:64], batch=2))) <= set(data)
    # run again onto its own file: replaced; the run's validation text by default
    rc, stdout, err = run_cli(["experts", str(tiny_run), "--json", str(out), "--quiet"], capsys)
    assert rc == 0, err
    assert "the validation text of" in stdout


@pytest.mark.parametrize("case", ["missing", "tokens0", "unknown", "no-run-data", "dense", "link", "foreign"])
def test_bad_input_is_one_line(case, tiny_run, corpus, tmp_path, capsys):
    argv = ["experts", str(tiny_run), "--quiet"]
    if case == "missing":
        argv[1] = str(tmp_path / "nothing")
    elif case == "tokens0":
        argv += ["--tokens", "0"]
    elif case == "unknown":
        (tmp_path / "t.txt").write_text("THE CAT")  # capitals: not in the tiny run's alphabet
        argv += ["--data", str(tmp_path / "t.txt")]
    elif case == "no-run-data":
        argv[1] = str(tiny_run / "last")  # a checkpoint folder: no validation text of its own
    elif case == "dense":
        from nanollama4.interop.hf import export_hf

        tok = CharTokenizer.from_text(corpus.read_text())
        export_hf(Transformer(preset("tiny", vocab_size=tok.vocab_size, n_experts=0)), tmp_path / "dense",
                  tok.save_hf)
        argv = ["experts", str(tmp_path / "dense"), "--data", str(corpus), "--quiet"]
    elif case == "link":
        (tmp_path / "elsewhere.json").write_text("{}")
        (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere.json")
        argv += ["--json", str(tmp_path / "link.json")]
    elif case == "foreign":
        (tmp_path / "notes.json").write_text('{"mine": 1}')
        argv += ["--json", str(tmp_path / "notes.json")]
    rc, out, err = run_cli(argv, capsys)
    line = assert_cli_error(rc, err, "experts")
    assert out == ""
    expected = {"missing": "does not exist", "tokens0": "at least 1", "unknown": "not in the vocabulary",
                "no-run-data": "--data", "dense": "no MoE layer", "link": "symbolic link", "foreign": "new file name"}
    assert expected[case] in line
    if case in ("link", "foreign"):
        assert (tmp_path / ("elsewhere.json" if case == "link" else "notes.json")).read_text() in ("{}", '{"mine": 1}')


def test_the_untrained_null_is_the_same_config_freshly_drawn(crowded):
    model, tok = crowded
    ids = np.array(tok.encode(TEXT))
    state = torch.random.get_rng_state()
    twin = untrained_twin(model, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random stream is untouched
    assert twin.cfg == model.cfg
    assert not torch.equal(twin.blocks[0].ffn.router.weight, model.blocks[0].ffn.router.weight)
    assert torch.equal(untrained_twin(model, seed=3).blocks[0].ffn.router.weight, twin.blocks[0].ffn.router.weight)
    report = experts(model, tok, ids, seed=3, untrained=True)
    alone = experts(twin, tok, ids, seed=3)
    assert report.untrained_seed == 3
    assert [u.token_mi for u in report.untrained] == [lay.token_mi for lay in alone.layers]
    assert report.untrained_paths == alone.paths.token_mi


def test_bpe_token_classes():
    from nanollama4.model.tokenizer import BPETokenizer

    tok = BPETokenizer.train(TEXT * 4, vocab_size=300)
    names, class_V = token_classes(tok, tok.vocab_size)
    got = {w: [names[class_V[i]] for i in tok.encode(w)] for w in (" the", " cat", "\n", "42", ".")}
    assert got == {" the": ["word-start"], " cat": ["word-start"], "\n": ["whitespace"], "42": ["digits"],
                   ".": ["punctuation"]}
    assert names[class_V[tok.encode("the")[0]]] == "word-inner"


def test_the_report_of_a_constructed_routing_by_hand():
    tok = CharTokenizer.from_text("ab.")  # ids: '.' 0, 'a' 1, 'b' 2
    ids = np.array([1, 1, 1, 1, 2, 2, 0, 0])  # a a a a b b . .
    # layer 0: a -> expert 0, b -> expert 0, . -> expert 1; layer 1: every token to expert 1 but one dropped '.'
    l0 = np.array([0, 0, 0, 0, 0, 0, 1, 1])
    l1 = np.array([1, 1, 1, 1, 1, 1, 1, -1])
    routes = Routes(ids, np.stack([l0, l1])[:, :, None].astype(np.int16), None, [0, 1], 4, 2, 2)
    report = analyse(routes, tok, tok.vocab_size, min_support=1)
    first, second = report.layers
    h = -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))  # the token decides the expert: I = H(expert)
    assert first.token_mi.bits == pytest.approx(h)
    assert [e.load for e in first.experts] == [0.75, 0.25]
    lifts = {t.token: t.lift for t in first.experts[1].top_owned}
    assert lifts == {".": pytest.approx(4.0)}  # P(. | 1) = 1 over P(.) = 2/8
    assert {t.token: t.lift for t in first.experts[0].top_owned} == {"a": pytest.approx(4 / 3),
                                                                     "b": pytest.approx(4 / 3)}
    assert [e.lift_cap for e in first.experts] == [pytest.approx(4 / 3), pytest.approx(4.0)]  # 1 / (k x load)
    # both of expert 0's tokens are taken whole: owned 1 each, the commoner first; a fills 4/6 of its slots
    assert [(t.token, t.owned, t.count, t.occurrences) for t in first.experts[0].top_owned] == [("a", 1.0, 4, 4),
                                                                                             ("b", 1.0, 2, 2)]
    assert [(t.token, t.share) for t in first.experts[0].top_count] == [("a", pytest.approx(4 / 6)),
                                                                        ("b", pytest.approx(2 / 6))]
    # each expert's part of I: its share of first choices x its D(...): they sum to the layer's I
    assert sum(e.part_bits for e in first.experts) == pytest.approx(first.token_mi.bits)
    assert first.classes == {"lowercase": 0.75, "uppercase": 0.0, "digit": 0.0, "space": 0.0, "newline": 0.0,
                             "punctuation": 0.25, "other": 0.0}
    assert first.experts[1].classes["punctuation"] == 1.0
    assert first.experts[1].kl_bits == pytest.approx(2.0)  # P(. | 1) = 1 against P(.) = 1/4
    assert all(e.kl_null_bits < e.kl_bits for e in first.experts)  # shuffled, the pairing is mostly lost
    assert second.dropped == 1 and second.dropped_by_token == [[0, 1]]
    assert second.token_mi.bits == pytest.approx(0, abs=1e-12)  # one expert takes all: no information
    # paths: the dropped token has none; 0-1 for a and b, 1-1 for the kept '.'
    assert [(p.experts, p.count) for p in report.paths.top] == [([0, 1], 6), ([1, 1], 1)]
    assert report.paths.best_layer == 0 and report.paths.best_layer_bits == pytest.approx(h)


def test_json_refuses_a_pipe_without_opening_it(tiny_run, tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "pipe.json")  # opening it to read would wait for a writer forever
    rc, out, err = run_cli(["experts", str(tiny_run), "--quiet", "--json", str(tmp_path / "pipe.json")], capsys)
    assert "not a file nanollama4 experts wrote" in assert_cli_error(rc, err, "experts")


def test_the_shared_share_is_the_norm_ratio_documented(crowded):
    from nanollama4.model.moe import moe_reference

    model, tok = crowded
    ids = np.array(tok.encode(TEXT))[:32]  # one window
    moe = model.moe_layers()[1]
    inputs = []
    handle = moe.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
    try:
        routes = route_stream(model, ids, quiet=True)
    finally:
        handle.remove()
    (x,) = inputs
    with torch.no_grad():
        shared = moe.shared_expert(x).reshape(32, -1).norm(dim=-1)
        routed = (moe_reference(moe, x) - moe.shared_expert(x)).reshape(32, -1).norm(dim=-1)
    torch.testing.assert_close(torch.from_numpy(routes.shared_LN[1]), shared / (shared + routed), rtol=1e-4,
                               atol=1e-6)


def test_compare_adds_each_runs_specialisation_by_layer(tiny_run, tmp_path, capsys):
    """`compare --experts N --untrained-null`: per run, the bits `experts` computes on the same N validation
    tokens, and the untrained twin's; a run whose checkpoint cannot be read keeps its row with a note."""
    import shutil

    from nanollama4.reports.routes import model_and_text

    broken = tmp_path / "broken"
    shutil.copytree(tiny_run, broken, symlinks=True)
    (broken / "step-0000004" / "model.safetensors").write_bytes(b"not a checkpoint")
    rc, stdout, err = run_cli(["compare", str(tiny_run), str(broken), "--out", str(tmp_path / "cmp"),
                               "--experts", "300", "--untrained-null"], capsys)
    assert rc == 0, err
    model, tok, ids, _ = model_and_text(tiny_run, None, 300)
    want = experts(model, tok, ids, untrained=True)
    row = next(line for line in stdout.splitlines() if line.startswith("| run |"))
    assert "I(expert; token) above its shuffle by MoE layer" in row  # never the raw bits (issue 71)
    row = next(line for line in stdout.splitlines() if line.startswith(f"| {tiny_run.name} | 300"))
    assert " / ".join(f"{lay.token_mi.bits - lay.token_mi.null_bits:.2f} ({lay.token_mi.normalised:.0%})"
                      for lay in want.layers) in row
    assert "(untrained " + " / ".join(f"{u.token_mi.above_null:.2f} ({u.token_mi.normalised:.0%})"
                                      for u in want.untrained) in row
    assert "| broken | - |" in stdout and "- broken: " in stdout
    assert "What the experts learned" in (tmp_path / "cmp" / "compare.md").read_text()


@pytest.mark.parametrize("how", ["same", "dotdot", "link"])
def test_json_and_html_naming_one_file_is_one_line(how, tiny_run, corpus, tmp_path, capsys):
    """Issue 69: `--json X --html X` wrote the JSON, then the page over it. Paths that name one file (through
    ".." or a linked folder) are refused before any work, as the other output clashes are."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path)
    out = tmp_path / "report.json"
    page = {"same": out, "dotdot": tmp_path / "sub" / ".." / "report.json", "link": tmp_path / "alias" / "report.json"}
    rc, stdout, err = run_cli(["experts", str(tiny_run), "--data", str(corpus), "--tokens", "64", "--json", str(out),
                               "--html", str(page[how]), "--quiet"], capsys)
    line = assert_cli_error(rc, err, "experts")
    assert "one file" in line and f"--json {out}" in line and "own file name" in line
    assert stdout == "" and not out.exists()
    rc, _, err = run_cli(["experts", str(tiny_run), "--data", str(corpus), "--tokens", "64", "--json", str(out),
                          "--html", str(tmp_path / "report.html"), "--quiet"], capsys)
    assert rc == 0 and json.loads(out.read_text())["tokens"] == 64, err


def _repeated(corpus, path, size: int):
    """`corpus`'s text repeated into `path` until it is at least `size` bytes."""
    block = corpus.read_text()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(size // len(block) + 1):
            f.write(block)
    return path


def _counting_reads(monkeypatch) -> list[int]:
    """The length of every piece of text read from now on (`corpus.iter_corpus`, which every reader of a text
    file goes through), in a list that grows as they are read."""
    from nanollama4.training import corpus as corpus_module

    read: list[int] = []
    iter_corpus = corpus_module.iter_corpus

    def counted(*args, **kwargs):
        for piece in iter_corpus(*args, **kwargs):
            read.append(len(piece))
            yield piece

    monkeypatch.setattr(corpus_module, "iter_corpus", counted)
    return read


def test_data_with_tokens_reads_only_the_prefix_it_routes(tiny_run, corpus, tmp_path, monkeypatch, capsys):
    """Issue 69: `experts --data FILE --tokens N` read and encoded all of FILE (1,000 tokens of a 50 MB text
    took 6.44 GB before the allocator gave up). It reads in pieces, as training does, and stops at N tokens:
    of a 48 MiB file, a piece or two (READ_BYTES each) is read."""
    from nanollama4.training.corpus import READ_BYTES

    big = _repeated(corpus, tmp_path / "big.txt", 48 * 2**20)
    read = _counting_reads(monkeypatch)
    out = tmp_path / "report.json"
    rc, stdout, err = run_cli(["experts", str(tiny_run), "--data", str(big), "--tokens", "1000", "--batch", "2",
                               "--json", str(out), "--quiet"], capsys)
    assert rc == 0, err
    assert f"text: {big}" in stdout and json.loads(out.read_text())["tokens"] == 1000
    assert 0 < sum(read) <= 2 * READ_BYTES, f"{sum(read):,} characters read to route 1,000 tokens"


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_text_ids_are_the_whole_texts_first_ids_read_no_further(kind, corpus, tmp_path, monkeypatch):
    """`routes.text_ids` gives the first N ids of the whole text's encoding, having read about a piece of it
    and allocated little more (tracemalloc's peak), and with no N every id."""
    import tracemalloc

    from nanollama4.model.tokenizer import BPETokenizer
    from nanollama4.reports.routes import text_ids
    from nanollama4.training.corpus import READ_BYTES

    text = corpus.read_text()
    tok = CharTokenizer.from_text(text) if kind == "char" else BPETokenizer.train(text, 300)
    big = _repeated(corpus, tmp_path / "big.txt", 6 * READ_BYTES)
    whole = np.asarray(tok.encode(big.read_text(encoding="utf-8")), dtype=np.int64)
    read = _counting_reads(monkeypatch)
    tracemalloc.start()
    try:
        got = text_ids([big], tok, 1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.dtype == np.int64 and np.array_equal(got, whole[:1000])
    assert sum(read) <= 2 * READ_BYTES, f"read {sum(read):,} characters for 1,000 tokens"
    assert peak < 3 * READ_BYTES + 2**20, f"{peak / 2**20:.1f} MiB allocated for 1,000 tokens"
    assert np.array_equal(text_ids([big], tok), whole)


def _routes_of(ids: np.ndarray, first: np.ndarray, n_experts: int) -> Routes:
    """Routes of one MoE layer in which token i went to expert first[i] (top-1, nothing dropped)."""
    return Routes(ids, first[None, :, None].astype(np.int16), None, [0], 64, -(-len(ids) // 64), n_experts)


def test_the_view_leads_with_what_fills_an_expert_not_rare_tokens_at_the_lift_cap(capsys):
    """Issue 71: an expert that spends 85% of its slots on spaces and takes a few rare letters whole listed
    the rare letters first (they tie at the lift cap). The view leads with what fills it, says what it owns
    with support counts, and breaks ownership ties by count."""
    from nanollama4.reports.expertsview import fills, owns, show_experts

    tok = CharTokenizer.from_text(" abcLQZ")
    sp, a, b, c, L, Q, Z = (tok.encode(ch)[0] for ch in " abcLQZ")
    # expert 0: 850 spaces of 1,000 spaces, and every L (60), Q (50), Z (40); expert 1: the rest
    ids = np.array([sp] * 1000 + [L] * 60 + [Q] * 50 + [Z] * 40 + [a] * 900 + [b] * 800 + [c] * 700)
    first = np.array([0] * 850 + [1] * 150 + [0] * 150 + [1] * 2400)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(ids))
    report = analyse(_routes_of(ids[order], first[order], 2), tok, tok.vocab_size)
    e0 = report.layers[0].experts[0]
    assert e0.assignments == 1000 and e0.top_count[0].token == " " and e0.top_count[0].share == pytest.approx(0.85)
    assert fills(e0).startswith("' ' 85% (850)")
    assert [t.token for t in e0.top_owned] == ["L", "Q", "Z", " "]  # taken whole, the commonest first; then 85%
    assert owns(e0, report.min_support).startswith("'L' 100% of 60  'Q' 100% of 50  'Z' 100% of 40  ' ' 85% of 1,000")
    assert e0.top_owned[0].lift == pytest.approx(e0.lift_cap)  # the cap, said: 1 / (k x load)
    show_experts(report)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("0 "))
    assert row.index("' ' 85%") < row.index("'L'")


def test_a_near_empty_expert_is_not_ranked_the_most_specialised():
    """Issue 71: experts of load ~0 with a handful of peculiar tokens showed the most bits. Ranked by their
    part of I above the shuffle (share of first choices x D), they come last."""
    from nanollama4.reports.experts import most_specialised

    rng = np.random.default_rng(1)
    ids = rng.integers(0, 20, size=20_000)
    first = (ids % 3).astype(np.int64)  # experts 0-2 split the tokens by their id mod 3
    rare = np.nonzero(ids == 19)[0][:3]
    first[rare] = 3  # expert 3 takes three tokens: all one id, far from the stream
    tok = CharTokenizer.from_text("abcdefghijklmnopqrst")
    layer = analyse(_routes_of(ids, first, 4), tok, tok.vocab_size).layers[0]
    e3 = layer.experts[3]
    assert e3.load < 0.001 and e3.kl_bits == max(e.kl_bits for e in layer.experts)  # the old ranking's first
    assert most_specialised(layer, 4)[-1].expert == 3
    assert all(e.expert != 3 for e in most_specialised(layer, 3))


@pytest.mark.parametrize("n_experts", [8, 32])
def test_the_excess_over_the_null_is_zero_for_routing_that_ignores_the_token(n_experts):
    """Issue 71: a shuffled routing's raw bits grow with the expert count (plug-in bias), so raw bits make
    a finer MoE look specialised for free. Its excess over the shuffle null is zero at 8 and at 32 experts,
    within the null's own spread, and the normalised form likewise; a routing the token decides reads 1."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, size=40_000)
    first = rng.integers(0, n_experts, size=len(ids))
    s = specialisation(first, ids, n_experts, 64, [0, 20_000, 40_000], permutations=5, seed=0)
    # the plug-in MI of independent labels is chi^2 / (2 N ln 2) with (E - 1)(V - 1) degrees of freedom: its
    # mean df / (2 N ln 2) (0.008 bits at 8 experts, 0.035 at 32), its spread sqrt(2 df) / (2 N ln 2)
    df, scale = (n_experts - 1) * 63, 2 * len(ids) * math.log(2)
    assert s.bits == pytest.approx(df / scale, abs=4 * math.sqrt(2 * df) / scale)  # raw bits: the bias alone
    assert abs(s.above_null) < 4 * math.sqrt(2 * df) / scale and abs(s.normalised) < 1e-3
    assert s.label_bits == pytest.approx(math.log2(n_experts), abs=0.01)
    decided = specialisation(ids % n_experts, ids, n_experts, 64, [0, 20_000, 40_000], permutations=5, seed=0)
    assert decided.normalised == pytest.approx(1.0, abs=0.02)


def test_the_fresh_router_null_routes_the_models_own_hidden_states_as_a_hand_computation():
    """Issue 71, the geometry null: each MoE layer's router input (the trained model's hidden states)
    routed by the untrained twin's router of that layer, first choice = its top logit (sigmoid router, no
    bias, no capacity), and by the nearest k-means centroid; I(choice; token) by hand."""
    from nanollama4.reports.experts import KMEANS_FIT, kmeans, nearest

    torch.manual_seed(0)
    tok = CharTokenizer.from_text(TEXT)
    model = Transformer(preset("tiny", vocab_size=tok.vocab_size, max_seq_len=32)).eval()
    ids = np.array(tok.encode(TEXT * 3))
    report = experts(model, tok, ids, batch=4, seed=5, geometry=True)
    twin = untrained_twin(model, seed=5)
    inputs = {m: [] for m in model.moe_layers()}
    handles = [m.router.register_forward_pre_hook(lambda mod, args, m=m: inputs[m].append(args[0].detach()))
               for m in model.moe_layers()]
    try:
        route_stream(model, ids, batch=4, quiet=True)
    finally:
        for h in handles:
            h.remove()
    assert report.geometry_seed == 5 and len(report.geometry) == len(model.moe_layers())
    V, E = model.cfg.vocab_size, model.cfg.n_experts
    for li, (moe, fresh) in enumerate(zip(model.moe_layers(), twin.moe_layers(), strict=True)):
        x = torch.cat(inputs[moe])  # the windows in the order route_stream ran them: whole ones, then the tail
        order = np.concatenate([np.arange(s, min(s + 32, len(ids))) for s in range(0, len(ids), 32)])
        choice = np.full(len(ids), -1)
        choice[order] = (x.float() @ fresh.router.weight.float().T).argmax(-1).numpy()
        want = mutual_information(joint_counts(choice, ids, E, V))
        assert report.geometry[li].fresh_router.bits == pytest.approx(want, abs=1e-9)
        assert report.geometry[li].fresh_router.bits != pytest.approx(report.layers[li].token_mi.bits, abs=1e-6)
        centroids = kmeans(x.float()[:KMEANS_FIT], E, seed=5)
        km = np.full(len(ids), -1)
        km[order] = nearest(x.float(), centroids).numpy()
        assert report.geometry[li].kmeans.bits == pytest.approx(mutual_information(joint_counts(km, ids, E, V)))


def test_kmeans_finds_separated_clusters():
    from nanollama4.reports.experts import kmeans, nearest

    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = torch.cat([c + 0.1 * torch.randn(50, 2, generator=g) for c in centres])
    found = kmeans(x, 3, seed=1)
    labels = nearest(x, found)
    assert all(len(set(labels[i * 50:(i + 1) * 50].tolist())) == 1 for i in range(3))
    assert len(set(labels.tolist())) == 3


def test_the_experiment_draws_each_runs_twin_from_its_own_seed(tiny_run):
    """Issue 71: one untrained twin (seed 0) was subtracted from every seed's run, so the interval left out
    the null's own variation. Each run's twin and geometry null are drawn from the run's seed."""
    from nanollama4.experiments.expert_specialisation import read
    from nanollama4.training.evaluation import validation_of_run

    got = {seed: read(str(tiny_run), 300, seed) for seed in (0, 7)}
    run = validation_of_run(tiny_run, max_tokens=300)
    for seed, doc in got.items():
        want = experts(run.model, run.tokenizer, run.tokens, untrained=True, geometry=True, seed=seed)
        assert doc["seed"] == seed
        assert [lay["untrained_token"]["bits"] for lay in doc["layers"]] == [u.token_mi.bits for u in want.untrained]
        assert [lay["fresh_router"]["bits"] for lay in doc["layers"]] == [g.fresh_router.bits for g in want.geometry]
    assert [lay["untrained_token"]["bits"] for lay in got[0]["layers"]] != \
        [lay["untrained_token"]["bits"] for lay in got[7]["layers"]]
    assert [lay["token"]["bits"] for lay in got[0]["layers"]] == [lay["token"]["bits"] for lay in got[7]["layers"]]
