"""What each expert learned, over a whole text: `experts(model, tokenizer, ids)` -> `ExpertsReport`.

The routing of every token (routes.py: windows of max_seq_len, eval mode, as generation routes) is read
per MoE layer into:
  - each expert's assignments (every kept slot) and first choices (a token's first kept slot), its load
    share, the shared expert's share of the output on its tokens;
  - its top tokens by count and by lift, P(token | expert) / P(token), each with a few contexts;
  - its assignments by token class (TOKEN_CLASSES: declared once, a dict name -> predicate per tokenizer);
  - the layer's specialisation: I(first expert; token) and I(first expert; class) in bits against the
    shuffle null (specialise.py), and each expert's part of it;
and across layers the commonest *paths* (the first experts of a token in every MoE layer) with
I(path; token) beside the best single layer's.

Limits: windows do not overlap, so the first tokens of each window are routed with little context; with
capacity in eval, which tokens are dropped depends on the batch (`--batch`), as it does in the model.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, shown
from ..fields import number
from ..model import Transformer
from ..tokenizer import CharTokenizer, Tokenizer, token_bytes, token_label
from .routes import Routes, route_stream
from .specialise import Specialisation, joint_counts, kl_per_row, lift, shuffled, specialisation

TOP = 8  # tokens listed per expert, by count and by lift
CONTEXTS = 3  # contexts kept per listed token
MIN_LIFT_COUNT = 20  # a token is ranked by lift only with at least this many assignments to the expert
TOP_PATHS = 10
CHUNKS = 10  # the stream is cut into at most this many chunks of whole windows, for the interval
PERMUTATIONS = 5  # shuffles of the labels per null


def _punctuation(s: str) -> bool:
    return bool(s) and all(unicodedata.category(c)[0] in "PS" for c in s)


# Token classes, per tokenizer kind: name -> predicate on the token's text. The first that holds names the
# class, and "other" takes the rest. Add a class here (or in your own code, before calling) and every view
# and the JSON carry it.
TOKEN_CLASSES: dict[str, dict[str, Callable[[str], bool]]] = {
    "char": {
        "lowercase": str.islower,
        "uppercase": str.isupper,
        "digit": str.isdigit,
        "space": lambda s: s in (" ", "\t"),
        "newline": lambda s: s in ("\n", "\r", "\r\n"),
        "punctuation": _punctuation,
    },
    "bpe": {
        "whitespace": lambda s: bool(s) and s.isspace(),
        "digits": lambda s: s.strip().isdigit(),
        "punctuation": lambda s: _punctuation(s.strip()),
        "word-start": lambda s: len(s) > 1 and s[0].isspace() and s[1:].isalpha(),
        "word-inner": str.isalpha,
    },
}
OTHER = "other"


def tokenizer_kind(tokenizer: Tokenizer) -> str:
    return "char" if isinstance(tokenizer, CharTokenizer) else "bpe"


def token_classes(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[str], np.ndarray]:
    """The class names (TOKEN_CLASSES of the tokenizer's kind, then "other") and each token id's class."""
    table = TOKEN_CLASSES[tokenizer_kind(tokenizer)]
    names = [*table, OTHER]
    class_V = np.full(vocab_size, len(table), dtype=np.int64)
    for v in range(min(vocab_size, tokenizer.vocab_size)):
        text = token_label(token_bytes(tokenizer, v))
        class_V[v] = next((i for i, test in enumerate(table.values()) if test(text)), len(table))
    return names, class_V


@dataclass
class TokenStat:
    """One token at one expert (or path)."""

    id: int
    token: str  # its text, control characters written as escapes (a newline is \\n)
    count: int  # its assignments to this expert (kept slots), or tokens on this path
    lift: float  # P(token | expert) / P(token)
    contexts: list[str] = field(default_factory=list)  # a few tokens either side, the token in ⟦ ⟧


@dataclass
class ExpertStat:
    expert: int
    assignments: int  # kept slots it was given
    first_choice: int  # tokens whose first kept slot it is
    load: float  # its share of the layer's kept slots (uniform: 1 / n_experts)
    kl_bits: float  # D(P(token | first choice = it) || P(token)) in bits: its part of the layer's MI
    kl_null_bits: float  # the same with the first choices shuffled over the tokens (its load kept), mean
    shared_share: float | None  # mean shared share over the tokens it is first choice of
    classes: dict[str, float]  # its assignments' shares by token class
    top_count: list[TokenStat]
    top_lift: list[TokenStat]  # tokens with >= min_lift_count assignments here, highest lift first


@dataclass
class LayerStat:
    layer: int  # block index in the model
    tokens: int
    slots: int  # tokens x experts_per_token
    dropped: int  # slots capacity left empty
    shared_share: float | None  # mean over tokens of |shared(x)| / (|shared(x)| + |routed(x)|); None: no shared expert
    token_mi: Specialisation  # I(first expert; token id)
    class_mi: Specialisation  # I(first expert; token class)
    classes: dict[str, float]  # the stream's tokens by class (what an expert's shares are read against)
    experts: list[ExpertStat]
    assignments: list[list[int]]  # [expert, token id, count] for every nonzero cell (kept slots)
    dropped_by_token: list[list[int]]  # [token id, dropped slots]


@dataclass
class PathStat:
    experts: list[int]  # the first expert in each MoE layer, in order
    count: int
    share: float
    top_tokens: list[TokenStat]  # by count, with lift against the stream


@dataclass
class Paths:
    top: list[PathStat]
    distinct: int  # paths taken at least once
    token_mi: Specialisation  # I(path; token id), tokens with a kept first slot in every layer
    best_layer: int | None  # the block whose I(first expert; token) is highest
    best_layer_bits: float


@dataclass
class UntrainedLayer:
    """The untrained null of one layer: the same config with fresh weights, routing the same text."""

    layer: int
    token_mi: Specialisation
    class_mi: Specialisation


@dataclass
class TrainingRouting:
    """A run's own routing statistics at its last validation (the "routing" block of its metrics.jsonl): one
    value per MoE layer for each declared statistic (`moe.ROUTING_STATISTICS`, which say what each means and
    in what unit). What the router did in training, beside how it routes this text in eval mode."""

    step: int
    values: dict[str, list[float]]  # statistic name -> one value per MoE layer, as logged


def training_routing(path: str | Path) -> TrainingRouting | None:
    """The last routing `path` logged, when it is a run folder with a metrics.jsonl that has one (else None).
    Only the declared statistics are taken, and only lists of finite numbers (the file may be anyone's)."""
    from ..moe import ROUTING_STATISTICS
    from ..plots import read_metrics

    metrics = Path(path) / "metrics.jsonl"
    if not metrics.is_file():
        return None
    _, vals = read_metrics(metrics)
    last = next((v for v in reversed(vals) if isinstance(v.get("routing"), dict)), None)
    if last is None or not isinstance(last.get("step"), int):
        return None
    values = {s.name: [float(x) for x in last["routing"][s.name]] for s in ROUTING_STATISTICS
              if isinstance(last["routing"].get(s.name), list)
              and all(number(x) for x in last["routing"][s.name])}
    return TrainingRouting(last["step"], values) if values else None


@dataclass
class ExpertsReport:
    tokens: int
    windows: int
    window: int
    batch: int
    tokenizer: str  # "char" or "bpe": which TOKEN_CLASSES apply
    classes: list[str]
    min_lift_count: int
    permutations: int
    layers: list[LayerStat]
    paths: Paths | None  # None for a model with fewer than two MoE layers
    untrained: list[UntrainedLayer] | None = None  # the untrained null per layer, when asked for
    untrained_paths: Specialisation | None = None  # I(path; token) of the untrained model
    untrained_seed: int | None = None  # the seed its weights were drawn from
    source: str = ""  # what was read: the model's path and the text's (the command fills it in)
    training: TrainingRouting | None = None  # the run's routing statistics at its last validation, if a run


def experts(model: Transformer, tokenizer: Tokenizer, ids: np.ndarray, batch: int = 16, quiet: bool = True,
            min_lift_count: int = MIN_LIFT_COUNT, seed: int = 0, untrained: bool = False) -> ExpertsReport:
    """Route all of `ids` through `model` (routes.route_stream) and read what each expert took. `untrained`
    also routes them through `untrained_twin(model, seed)` and keeps its specialisation: how much of the
    trained number a model gets with no training at all (a freshly initialised router already sorts tokens
    by their embeddings, so the shuffle null alone would call that "learned")."""
    if not any(True for _ in model.moe_layers()):
        raise ConfigError("this model has no MoE layer (every feed-forward is dense): there are no experts to "
                          "read; pass a model with n_experts > 1")
    if len(ids) == 0:
        raise ConfigError("the text has no tokens; give some text to route")
    routes = route_stream(model, ids, batch=batch, quiet=quiet)
    report = analyse(routes, tokenizer, model.cfg.vocab_size, batch, min_lift_count, seed)
    if untrained:
        twin = analyse(route_stream(untrained_twin(model, seed), ids, batch=batch, quiet=quiet), tokenizer,
                       model.cfg.vocab_size, batch, min_lift_count, seed)
        report.untrained = [UntrainedLayer(lay.layer, lay.token_mi, lay.class_mi) for lay in twin.layers]
        report.untrained_paths = twin.paths.token_mi if twin.paths is not None else None
        report.untrained_seed = seed
    return report


def untrained_twin(model: Transformer, seed: int = 0) -> Transformer:
    """The same config freshly initialised from `seed` (the global RNG left as it was), in the model's dtype,
    on its device, with the fast modules installed as the loaders install them."""
    from ..ops import build_model

    param = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        twin = build_model(model.cfg)
    return twin.to(device=param.device, dtype=param.dtype)


def analyse(routes: Routes, tokenizer: Tokenizer, vocab_size: int, batch: int = 16,
            min_lift_count: int = MIN_LIFT_COUNT, seed: int = 0) -> ExpertsReport:
    """The report of routes already taken (`experts` = route_stream + this)."""
    names, class_V = token_classes(tokenizer, vocab_size)
    ids, W = routes.ids, routes.window
    n_chunks = min(CHUNKS, routes.windows)
    bounds = [min(len(ids), round(i * routes.windows / n_chunks) * W) for i in range(n_chunks + 1)]
    reader = _Contexts(tokenizer, ids)
    layers = [_layer(routes, li, tokenizer, vocab_size, names, class_V, bounds, min_lift_count, seed, reader)
              for li in range(len(routes.layers))]
    paths = _paths(routes, tokenizer, vocab_size, bounds, layers, seed) if len(layers) > 1 else None
    return ExpertsReport(len(ids), routes.windows, W, batch, tokenizer_kind(tokenizer), names, min_lift_count,
                         PERMUTATIONS, layers, paths)


def _layer(routes: Routes, li: int, tokenizer: Tokenizer, V: int, names: list[str], class_V: np.ndarray,
           bounds: list[int], min_lift_count: int, seed: int, reader: _Contexts) -> LayerStat:
    ids, E = routes.ids, routes.n_experts
    e_NK = routes.experts_LNK[li].astype(np.int64)
    K = e_NK.shape[1]
    kept = e_NK >= 0
    tok_NK = np.broadcast_to(ids[:, None], e_NK.shape)
    assign_EV = joint_counts(e_NK[kept], tok_NK[kept], E, V)  # (E, V) kept slots
    first = e_NK[:, 0]
    first_EV = joint_counts(first[first >= 0], ids[first >= 0], E, V)
    dropped_V = np.bincount(tok_NK[~kept], minlength=V)
    n_kept = int(assign_EV.sum())
    lift_EV = lift(assign_EV)
    kl_E = kl_per_row(first_EV)
    rng, has = np.random.default_rng(seed), first >= 0
    kl_null_E = np.mean([kl_per_row(joint_counts(shuffled(first[has], rng), ids[has], E, V))
                         for _ in range(PERMUTATIONS)], axis=0)
    class_EC = assign_EV @ np.eye(len(names), dtype=np.int64)[class_V]  # (E, classes)
    stream_C = np.bincount(class_V[ids], minlength=len(names))
    shared = routes.shared_LN[li] if routes.shared_LN is not None else None
    experts_out = []
    for e in range(E):
        row = assign_EV[e]
        by_count = [v for v in np.argsort(-row, kind="stable")[:TOP] if row[v] > 0]
        eligible = np.nonzero(row >= min_lift_count)[0]
        by_lift = eligible[np.argsort(-lift_EV[e, eligible], kind="stable")][:TOP]

        def stat(v: int, e: int = e) -> TokenStat:
            return TokenStat(int(v), reader.text(int(v)), int(assign_EV[e, v]), float(lift_EV[e, v]),
                             reader.at(routes, li, e, int(v)))

        mine = first == e
        experts_out.append(ExpertStat(
            e, int(row.sum()), int(first_EV[e].sum()), float(row.sum() / max(n_kept, 1)), float(kl_E[e]),
            float(kl_null_E[e]),
            float(shared[mine].mean()) if shared is not None and mine.any() else None,
            {n: float(class_EC[e, c] / max(row.sum(), 1)) for c, n in enumerate(names)},
            [stat(v) for v in by_count], [stat(v) for v in by_lift]))
    return LayerStat(
        routes.layers[li], len(ids), len(ids) * K, int((~kept).sum()),
        float(shared.mean()) if shared is not None else None,
        specialisation(first, ids, E, V, bounds, PERMUTATIONS, seed),
        specialisation(first, class_V[ids], E, len(names), bounds, PERMUTATIONS, seed),
        {n: float(stream_C[c] / len(ids)) for c, n in enumerate(names)}, experts_out,
        [[int(e), int(v), int(assign_EV[e, v])] for e, v in zip(*np.nonzero(assign_EV), strict=True)],
        [[int(v), int(dropped_V[v])] for v in np.nonzero(dropped_V)[0]])


def _paths(routes: Routes, tokenizer: Tokenizer, V: int, bounds: list[int], layers: list[LayerStat],
           seed: int) -> Paths:
    """The commonest paths (first kept expert per MoE layer) and I(path; token) against the shuffle null.
    Tokens dropped from every slot of some layer have no path and are left out."""
    first_NL = routes.first_LN.T.astype(np.int64)  # (N, L)
    whole = (first_NL >= 0).all(1)
    unique_PL, path_N = np.unique(first_NL[whole], axis=0, return_inverse=True)
    path_N = path_N.reshape(-1)
    label = np.full(len(routes.ids), -1, dtype=np.int64)
    label[whole] = path_N
    count_P = np.bincount(path_N, minlength=len(unique_PL))
    p_V = np.bincount(routes.ids, minlength=V) / len(routes.ids)
    reader = _Contexts(tokenizer, routes.ids)
    top = []
    for p in np.argsort(-count_P, kind="stable")[:TOP_PATHS]:
        toks = np.bincount(routes.ids[label == p], minlength=V)
        best = [v for v in np.argsort(-toks, kind="stable")[:TOP] if toks[v] > 0]
        top.append(PathStat([int(e) for e in unique_PL[p]], int(count_P[p]), float(count_P[p] / len(routes.ids)),
                            [TokenStat(int(v), reader.text(int(v)), int(toks[v]),
                                       float(toks[v] / count_P[p] / p_V[v])) for v in best]))
    best_layer = max(layers, key=lambda lay: lay.token_mi.bits)
    return Paths(top, len(unique_PL), specialisation(label, routes.ids, len(unique_PL), V, bounds, PERMUTATIONS, seed),
                 best_layer.layer, best_layer.token_mi.bits)


class _Contexts:
    """A few tokens either side of a token's occurrences, read from the stream: each token id's positions
    are found once (one stable sort of the ids), then filtered by the expert that took them."""

    def __init__(self, tokenizer: Tokenizer, ids: np.ndarray, width: int | None = None) -> None:
        self.tokenizer, self.ids = tokenizer, ids
        self.width = width if width is not None else (10 if isinstance(tokenizer, CharTokenizer) else 4)
        self.order = np.argsort(ids, kind="stable")
        self.starts = np.searchsorted(ids[self.order], np.arange(int(ids.max()) + 2))

    def text(self, v: int) -> str:
        return shown(token_label(token_bytes(self.tokenizer, v)))

    def at(self, routes: Routes, li: int, e: int, v: int) -> list[str]:
        """Up to CONTEXTS places where token v went to expert e in layer li, spread over the stream."""
        pos = self.order[self.starts[v]:self.starts[v + 1]]
        pos = pos[(routes.experts_LNK[li, pos] == e).any(-1)]
        if len(pos) > CONTEXTS:
            pos = pos[np.linspace(0, len(pos) - 1, CONTEXTS).round().astype(np.int64)]
        return [self._around(int(p)) for p in pos]

    def _around(self, p: int) -> str:
        w, ids = self.width, self.ids
        left = self.tokenizer.decode(ids[max(0, p - w):p].tolist())
        right = self.tokenizer.decode(ids[p + 1:p + 1 + w].tolist())
        return shown(left) + "⟦" + self.text(int(ids[p])) + "⟧" + shown(right)
