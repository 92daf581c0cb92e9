"""A text of any length through the model, keeping each MoE layer's routing of every token.

`route_stream` cuts the ids into non-overlapping windows of the model's max_seq_len, runs several windows
per forward pass (eval mode, no gradient: the balancing bias and, where the config applies it in eval, the
capacity act exactly as in generation), and reads each MoE layer's decision through the project's own
observers (`observe.observe`), plus the shared expert's and the layer's outputs through forward hooks. What
it keeps is small beside the text itself: per layer and token, the expert of each slot (int16, -1 for a
dropped slot) and the shared expert's share of the output (float32). The counts, the contexts and the paths
of `experts.analyse` are all read from these arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..base.errors import DataError
from ..engine.observe import observe
from ..model.moe import MoE
from ..model.tokenizer import CharTokenizer, Tokenizer, UnknownCharacters
from ..model.transformer import Transformer


@dataclass
class Routes:
    """Every token's routing through every MoE layer (L MoE layers, N tokens, K slots)."""

    ids: np.ndarray  # (N,) the token ids, int64
    experts_LNK: np.ndarray  # (L, N, K) int16: each kept slot's expert, -1 where capacity dropped the slot
    shared_LN: np.ndarray | None  # (L, N) float32: |shared(x)| / (|shared(x)| + |routed(x)|), None: no shared expert
    layers: list[int]  # each MoE layer's block index in the model
    window: int  # tokens per window (the model's max_seq_len)
    windows: int  # windows read (the last may be shorter)
    n_experts: int

    @property
    def first_LN(self) -> np.ndarray:
        """Each token's first kept expert per layer (-1 when every slot was dropped): its own top choice when
        routing is dropless; with capacity, the best expert that still had room (slots fill in order)."""
        return self.experts_LNK[:, :, 0]


def moe_layers(model: Transformer) -> list[tuple[int, MoE]]:
    """(block index, MoE) of each block whose feed-forward is a mixture of experts."""
    return [(i, b.ffn) for i, b in enumerate(model.blocks) if isinstance(b.ffn, MoE)]


RouterInputs = Callable[[int, torch.Tensor, np.ndarray], None]  # (MoE layer, its router's input (T, D), positions)


def route_stream(model: Transformer, ids: np.ndarray, batch: int = 16, quiet: bool = False,
                 inputs: RouterInputs | None = None) -> Routes:
    """Route all of `ids` through `model` in windows of max_seq_len, `batch` windows per forward pass.
    `inputs`, when given, is called after each pass with every MoE layer's router input and the stream
    positions of its rows (what the geometry null routes again).

    The model is left in the train/eval mode it was in, and its balancing counters as they were."""
    layers = moe_layers(model)
    ids = np.asarray(ids, dtype=np.int64)
    W, N = model.cfg.max_seq_len, len(ids)
    K = model.cfg.experts_per_token
    experts_LNK = np.full((len(layers), N, K), -1, dtype=np.int16)
    shared = any(m.shared_expert is not None for _, m in layers)
    shared_LN = np.zeros((len(layers), N), dtype=np.float32) if shared else None
    modes = {m: m.training for m in model.modules()}
    device = next(model.parameters()).device
    starts = list(range(0, N, W))
    full = [s for s in starts if s + W <= N]
    groups = [full[i:i + batch] for i in range(0, len(full), batch)] + [[s] for s in starts if s + W > N]
    model.eval()
    try:
        with torch.no_grad(), observe(model, attention=False) as seen, _outputs(layers, inputs is not None) as outs, \
                tqdm(total=N, unit="tok", unit_scale=True, desc="routing", disable=quiet or None) as bar:
            for group in groups:
                span = min(W, N - group[0])
                x = torch.from_numpy(np.stack([ids[s:s + span] for s in group])).to(device)  # (B, span)
                model(x)
                where = (np.asarray(group)[:, None] + np.arange(span)[None, :]).reshape(-1)  # positions, row-major
                for li, (_, moe) in enumerate(layers):
                    if inputs is not None:
                        inputs(li, outs["in"][moe], where)
                    r = seen["routing"][moe]
                    e_TK = r.experts_TK if r.valid_TK is None else r.experts_TK.masked_fill(~r.valid_TK, -1)
                    experts_LNK[li, where] = e_TK.cpu().numpy().astype(np.int16)
                    if shared_LN is not None and moe in outs["shared"]:
                        s_T = outs["shared"][moe].float().norm(dim=-1)
                        routed_T = (outs["out"][moe].float().reshape(len(where), -1) - outs["shared"][moe].float()
                                    ).norm(dim=-1)
                        shared_LN[li, where] = (s_T / (s_T + routed_T).clamp_min(1e-12)).cpu().numpy()
                bar.update(len(where))
    finally:
        for m, training in modes.items():
            m.training = training
    return Routes(ids, experts_LNK, shared_LN, [i for i, _ in layers], W, len(starts),
                  layers[0][1].n_experts if layers else 0)


class _outputs:
    """Forward hooks that keep, per MoE layer, its output and its shared expert's output (T, D) of the
    last pass, and with `inputs` its router's input; removed on exit."""

    def __init__(self, layers: list[tuple[int, MoE]], inputs: bool = False) -> None:
        self.layers, self.seen, self.handles, self.inputs = layers, {"shared": {}, "out": {}, "in": {}}, [], inputs

    def __enter__(self) -> dict:
        for _, moe in self.layers:
            self.handles.append(moe.register_forward_hook(self._keep("out", moe)))
            if self.inputs:
                self.handles.append(moe.router.register_forward_pre_hook(self._keep_input(moe)))
            if moe.shared_expert is not None:
                self.handles.append(moe.shared_expert.register_forward_hook(self._keep("shared", moe)))
        return self.seen

    def _keep(self, what: str, moe: MoE):
        def hook(module, inputs, output):  # noqa: ARG001
            self.seen[what][moe] = output.detach()

        return hook

    def _keep_input(self, moe: MoE):
        def hook(module, args):  # noqa: ARG001
            self.seen["in"][moe] = args[0].detach()

        return hook

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()


def model_and_text(path: str | Path, data: str | Path | None = None, max_tokens: int | None = None,
                   fix: str | None = None) -> tuple[Transformer, Tokenizer, np.ndarray, str]:
    """The model at `path` (a run, a checkpoint folder or a transformers folder, as `generate` loads it), the
    ids of the text to route (the first `max_tokens`) and where that text came from: `data` (a file, a folder
    or a glob, read in pieces: `text_ids`) when given, else a run's validation text, read back only where it
    is the text the run recorded (`runtext.read_run_text`, whose refusal ends with `fix`); a folder with no
    run needs `data`."""
    from ..interop.hf import load_any
    from ..training.corpus import check_fits_in_memory, find_corpus_files
    from ..training.evaluation import validation_of_run
    from ..training.runs import is_run_dir
    from ..training.runtext import FIX_EXPERTS

    if data is None:
        if not Path(path).exists():
            load_any(path)  # its own line for a path that is not there
        if not Path(path).is_dir() or not is_run_dir(Path(path)):
            raise DataError(f"{path} is not a run folder, so it has no validation text of its own; pass --data TEXT "
                            "(a text file, a folder or a quoted glob) to route")
        run = validation_of_run(path, max_tokens=max_tokens, fix=fix or FIX_EXPERTS)
        ids, source = np.asarray(run.tokens, dtype=np.int64), f"the validation text of {path}"
        model, tokenizer = run.model, run.tokenizer
    else:
        files = find_corpus_files(data)  # a missing source is one line before the model is read
        if max_tokens is None:  # all of it is routed: its ids and routes must fit (with a prefix, they do)
            check_fits_in_memory(files)
        model, tokenizer = load_any(path)
        try:
            ids = text_ids(files, tokenizer, max_tokens)
        except UnknownCharacters as e:
            raise DataError(f"--data {data}: {e.listing}; give a text in the model's alphabet") from None
        source = str(data)
    if len(ids) == 0:
        raise DataError(f"{source} has no tokens to route; give some text")
    return model, tokenizer, ids, source


def text_ids(files: list[Path], tokenizer: Tokenizer, max_tokens: int | None = None) -> np.ndarray:
    """The ids of the files' text, or of its first `max_tokens` tokens, read and encoded in pieces as training
    reads a corpus (`corpus.iter_corpus`, `corpus.encoded_pieces`: the ids are those of the whole text), and
    no further than those tokens: memory holds the ids routed and a piece or two of text (about a MiB),
    whatever the size of the files (a whole 50 MB text read to route 1,000 of its tokens once took 6 GB).
    A character tokenizer's ids are one a character, so its pieces are cut anywhere, to the characters
    needed. A BPE's are cut where no token can span the cut (so a text with no such line break reads on
    until one comes), and for a prefix encoded one piece of ENCODE_PIECE characters at a time rather than
    in training's parallel groups, whose ids would be a MiB of text's, however few are routed."""
    from ..training.corpus import ENCODE_PIECE, empty_corpus, encodable_pieces, encoded_pieces, iter_corpus

    chunks: list[np.ndarray] = []
    n, visible, whole = 0, False, True
    text = iter_corpus(files)
    try:
        if isinstance(tokenizer, CharTokenizer):
            pieces = ((p, tokenizer.encode(p)) for p in _cut(text, max_tokens))
        elif max_tokens is not None:
            pieces = ((p, tokenizer.encode(p)) for p in encodable_pieces(text, ENCODE_PIECE))
        else:
            pieces = encoded_pieces(text, tokenizer)
        for piece, encoded in pieces:
            visible = visible or bool(piece.strip())
            chunks.append(np.asarray(encoded, dtype=np.int64)[:None if max_tokens is None else max_tokens - n])
            n += len(chunks[-1])
            if max_tokens is not None and n >= max_tokens:
                whole = False
                break
    finally:
        text.close()  # a prefix: the file is closed now, not when the generator is collected
    if whole and not visible:
        raise empty_corpus(files)
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)


def _cut(pieces: Iterator[str], max_tokens: int | None) -> Iterator[str]:
    """The text of `pieces` up to its first `max_tokens` characters (all of it for None)."""
    left = max_tokens
    for piece in pieces:
        if left is not None:
            piece = piece[:left]
            left -= len(piece)
        yield piece
        if left == 0:
            return
