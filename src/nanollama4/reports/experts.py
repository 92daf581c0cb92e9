"""What each expert learned, over a whole text: `experts(model, tokenizer, ids)` -> `ExpertsReport`.

The routing of every token (routes.py: windows of max_seq_len, eval mode, as generation routes) is read
per MoE layer into:
  - each expert's assignments (every kept slot) and first choices (a token's first kept slot), its load
    share, the shared expert's share of the output on its tokens;
  - what fills it: its commonest tokens with their share of its slots; and what it owns: the tokens it
    takes the largest share of (of their occurrences), among those it took at least `min_support` times,
    ties broken by count. Lift, P(token | expert) / P(token), is kept on each token with its cap: an expert
    that takes a token whole has lift 1 / (k x load), so lift ranks rare tokens taken whole first and halves
    at k = 2 for the same routing; ownership does neither;
  - its assignments by token class (TOKEN_CLASSES: declared once, a dict name -> predicate per tokenizer);
  - the layer's specialisation: I(first expert; token) and I(first expert; class) in bits against the
    shuffle null (specialise.py), the excess over it and that excess over H(expert) (what compares across
    expert counts), and each expert's part of it, weighted by its share of first choices, so that a
    near-empty expert with a peculiar handful of tokens is not ranked the most specialised;
and across layers the commonest *paths* (the first experts of a token in every MoE layer) with
I(path; token) beside the best single layer's. Two nulls need another model: the untrained twin (the same
config freshly drawn routes the text) and the geometry null (the trained model's own hidden states routed
by a fresh router and by k-means: what the representation sorts before any router learns).

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

from ..base.errors import ConfigError, shown
from ..base.fields import number
from ..model.tokenizer import CharTokenizer, Tokenizer, token_bytes, token_label
from ..model.transformer import Transformer
from .routes import Routes, route_stream
from .specialise import Specialisation, joint_counts, kl_per_row, lift, shuffled, specialisation

TOP = 8  # tokens listed per expert, by count (what fills it) and by ownership (what it owns)
CONTEXTS = 3  # contexts kept per listed token
MIN_SUPPORT = 20  # a token is ranked by ownership only with at least this many assignments to the expert
KMEANS_FIT = 16_384  # tokens whose hidden states fit the k-means null (the stream's first), per layer
KMEANS_ITERATIONS = 30
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
    lift: float  # P(token | expert) / P(token): at most the expert's lift_cap
    contexts: list[str] = field(default_factory=list)  # a few tokens either side, the token in ⟦ ⟧
    share: float = 0.0  # count / the expert's assignments (or the path's tokens): how much of it this token fills
    occurrences: int = 0  # the token's occurrences in the stream
    owned: float = 0.0  # count / occurrences: the share of this token's occurrences the expert (path) takes


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
    top_count: list[TokenStat]  # what fills it: its commonest tokens, with their share of its slots
    top_owned: list[TokenStat]  # what it owns: tokens with >= min_support assignments here, by `owned`, then count
    lift_cap: float  # the largest lift a token can have here, 1 / (k x load): the lift of a token taken whole
    part_bits: float  # P(first choice = it) x kl_bits: its part of the layer's I(expert; token) (they sum to it)
    part_null_bits: float  # the same of the shuffle null

    @property
    def part_above_null(self) -> float:
        """Its part of the layer's specialisation above chance: what `most_specialised` ranks by. Weighted by
        its share of first choices, so an expert that takes almost nothing adds almost nothing, however
        peculiar its few tokens (their D(P(token | it) || P(token)) is large and mostly noise)."""
        return self.part_bits - self.part_null_bits


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


def most_specialised(layer: LayerStat, n: int) -> list[ExpertStat]:
    """The layer's n experts whose part of I(first expert; token) above the shuffle null is largest (load
    weighed in: `ExpertStat.part_above_null`)."""
    return sorted(layer.experts, key=lambda e: -e.part_above_null)[:n]


@dataclass
class GeometryLayer:
    """The geometry null of one layer: the trained model's own hidden states (the router's input) routed by
    another rule, which knows nothing the router learned. fresh_router: the untrained twin's router of this
    layer (its initial weights, no balancing bias); kmeans: the nearest of n_experts centroids fitted by
    k-means on the stream's first KMEANS_FIT tokens. The trained router's bits above these are what it
    learned beyond the sorting the representation already makes."""

    layer: int
    fresh_router: Specialisation
    kmeans: Specialisation


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
    from ..model.moe import ROUTING_STATISTICS
    from .plots import read_metrics

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
    min_support: int
    permutations: int
    layers: list[LayerStat]
    paths: Paths | None  # None for a model with fewer than two MoE layers
    untrained: list[UntrainedLayer] | None = None  # the untrained null per layer, when asked for
    untrained_paths: Specialisation | None = None  # I(path; token) of the untrained model
    untrained_seed: int | None = None  # the seed its weights were drawn from
    geometry: list[GeometryLayer] | None = None  # the geometry null per layer, when asked for
    geometry_seed: int | None = None  # the seed of the fresh routers and of k-means
    source: str = ""  # what was read: the model's path and the text's (the command fills it in)
    training: TrainingRouting | None = None  # the run's routing statistics at its last validation, if a run


def experts(model: Transformer, tokenizer: Tokenizer, ids: np.ndarray, batch: int = 16, quiet: bool = True,
            min_support: int = MIN_SUPPORT, seed: int = 0, untrained: bool = False,
            geometry: bool = False) -> ExpertsReport:
    """Route all of `ids` through `model` (routes.route_stream) and read what each expert took. `untrained`
    also routes them through `untrained_twin(model, seed)` and keeps its specialisation: how much of the
    trained number a model gets with no training at all (a freshly initialised router already sorts tokens
    by their embeddings, so the shuffle null alone would call that "learned"). `geometry` also routes the
    trained model's own hidden states through a fresh router and through k-means (`GeometryNull`): how much
    the representation sorts by itself, whatever the router learned."""
    if not any(True for _ in model.moe_layers()):
        raise ConfigError("this model has no MoE layer (every feed-forward is dense): there are no experts to "
                          "read; pass a model with n_experts > 1")
    if len(ids) == 0:
        raise ConfigError("the text has no tokens to route; give some text")
    fresh = untrained_twin(model, seed) if untrained or geometry else None
    null = GeometryNull(model, len(ids), seed, fresh) if geometry else None
    routes = route_stream(model, ids, batch=batch, quiet=quiet, inputs=null)
    report = analyse(routes, tokenizer, model.cfg.vocab_size, batch, min_support, seed)
    if untrained:
        twin = analyse(route_stream(fresh, ids, batch=batch, quiet=quiet), tokenizer,
                       model.cfg.vocab_size, batch, min_support, seed)
        report.untrained = [UntrainedLayer(lay.layer, lay.token_mi, lay.class_mi) for lay in twin.layers]
        report.untrained_paths = twin.paths.token_mi if twin.paths is not None else None
        report.untrained_seed = seed
    if null is not None:
        fresh_LN, kmeans_LN = null.labels()
        bounds, E, V = _bounds(routes), routes.n_experts, model.cfg.vocab_size

        def null_of(labels: np.ndarray) -> Specialisation:
            return specialisation(labels, routes.ids, E, V, bounds, PERMUTATIONS, seed)

        report.geometry = [GeometryLayer(block, null_of(fresh_LN[li]), null_of(kmeans_LN[li]))
                           for li, block in enumerate(routes.layers)]
        report.geometry_seed = seed
    return report


class GeometryNull:
    """Called by `route_stream` with each MoE layer's router input (the trained model's hidden states) on
    every pass: routes them by the untrained twin's router of that layer, and by the nearest of n_experts
    k-means centroids, fitted on the first KMEANS_FIT tokens (held until then, so memory stays at about
    KMEANS_FIT x d_model floats a layer) and then applied to every token. Each keeps one first choice a
    token (-1 where the fresh router's capacity, if the config applies it in eval, dropped every slot)."""

    def __init__(self, model: Transformer, n_tokens: int, seed: int = 0, twin: Transformer | None = None) -> None:
        twin = twin if twin is not None else untrained_twin(model, seed)
        self.routers = [m.router.eval() for m in twin.moe_layers()]
        self.n_experts, self.seed = model.cfg.n_experts, seed
        self.fresh_LN = np.full((len(self.routers), n_tokens), -1, dtype=np.int64)
        self.kmeans_LN = np.full((len(self.routers), n_tokens), -1, dtype=np.int64)
        self.held: list[list[tuple[torch.Tensor, np.ndarray]]] = [[] for _ in self.routers]
        self.centroids: list[torch.Tensor | None] = [None for _ in self.routers]

    def __call__(self, li: int, x_TD: torch.Tensor, where: np.ndarray) -> None:
        r = self.routers[li](x_TD)
        first = r.experts_TK[:, 0] if r.valid_TK is None else r.experts_TK[:, 0].masked_fill(~r.valid_TK[:, 0], -1)
        self.fresh_LN[li, where] = first.cpu().numpy()
        x = x_TD.detach().float().cpu()
        if self.centroids[li] is None:
            self.held[li].append((x, where))
            if sum(len(w) for _, w in self.held[li]) >= KMEANS_FIT:
                self._fit(li)
        else:
            self.kmeans_LN[li, where] = nearest(x, self.centroids[li]).numpy()

    def _fit(self, li: int) -> None:
        x = torch.cat([h for h, _ in self.held[li]])
        self.centroids[li] = kmeans(x[:KMEANS_FIT], self.n_experts, KMEANS_ITERATIONS, self.seed)
        for h, where in self.held[li]:
            self.kmeans_LN[li, where] = nearest(h, self.centroids[li]).numpy()
        self.held[li] = []

    def labels(self) -> tuple[np.ndarray, np.ndarray]:
        """(fresh router, k-means) first choices, (L, N) each; a stream shorter than KMEANS_FIT is fitted whole."""
        for li, c in enumerate(self.centroids):
            if c is None and self.held[li]:
                self._fit(li)
        return self.fresh_LN, self.kmeans_LN


def nearest(x_ND: torch.Tensor, c_KD: torch.Tensor) -> torch.Tensor:
    """Each row's nearest centroid (Euclidean), (N,) int64."""
    return torch.cdist(x_ND, c_KD).argmin(1)


def kmeans(x_ND: torch.Tensor, k: int, iterations: int = KMEANS_ITERATIONS, seed: int = 0) -> torch.Tensor:
    """k centroids of the rows of x by Lloyd's algorithm from a k-means++ start (each next centre drawn with
    probability proportional to its squared distance from the nearest chosen), seeded; a cluster that
    empties keeps its centre. Stops early when no assignment changes."""
    g = torch.Generator().manual_seed(seed)
    n = x_ND.shape[0]
    c = x_ND[torch.randint(n, (1,), generator=g)]
    d2 = ((x_ND - c[0]) ** 2).sum(1)
    for _ in range(1, k):
        total = float(d2.sum())
        i = torch.multinomial(d2 / total, 1, generator=g) if total > 0 else torch.randint(n, (1,), generator=g)
        c = torch.cat([c, x_ND[i]])
        d2 = torch.minimum(d2, ((x_ND - x_ND[i]) ** 2).sum(1))
    assign = None
    for _ in range(iterations):
        new = nearest(x_ND, c)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        sums = torch.zeros_like(c).index_add_(0, assign, x_ND)
        counts = torch.bincount(assign, minlength=k).unsqueeze(1)
        c = torch.where(counts > 0, sums / counts.clamp_min(1), c)
    return c


def untrained_twin(model: Transformer, seed: int = 0) -> Transformer:
    """The same config freshly initialised from `seed` (the global RNG left as it was), in the model's dtype,
    on its device, with the fast modules installed as the loaders install them."""
    from ..ops import build_model

    param = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        twin = build_model(model.cfg)
    return twin.to(device=param.device, dtype=param.dtype)


def _bounds(routes: Routes) -> list[int]:
    """The stream cut into at most CHUNKS chunks of whole windows (the interval's samples)."""
    n_chunks = min(CHUNKS, routes.windows)
    return [min(len(routes.ids), round(i * routes.windows / n_chunks) * routes.window) for i in range(n_chunks + 1)]


def analyse(routes: Routes, tokenizer: Tokenizer, vocab_size: int, batch: int = 16,
            min_support: int = MIN_SUPPORT, seed: int = 0) -> ExpertsReport:
    """The report of routes already taken (`experts` = route_stream + this)."""
    names, class_V = token_classes(tokenizer, vocab_size)
    ids, bounds = routes.ids, _bounds(routes)
    reader = _Contexts(tokenizer, ids)
    layers = [_layer(routes, li, vocab_size, names, class_V, bounds, min_support, seed, reader)
              for li in range(len(routes.layers))]
    paths = _paths(routes, tokenizer, vocab_size, bounds, layers, seed) if len(layers) > 1 else None
    return ExpertsReport(len(ids), routes.windows, routes.window, batch, tokenizer_kind(tokenizer), names,
                         min_support, PERMUTATIONS, layers, paths)


def _layer(routes: Routes, li: int, V: int, names: list[str], class_V: np.ndarray, bounds: list[int],
           min_support: int, seed: int, reader: _Contexts) -> LayerStat:
    ids, E = routes.ids, routes.n_experts
    e_NK = routes.experts_LNK[li].astype(np.int64)
    K = e_NK.shape[1]
    kept = e_NK >= 0
    tok_NK = np.broadcast_to(ids[:, None], e_NK.shape)
    assign_EV = joint_counts(e_NK[kept], tok_NK[kept], E, V)  # (E, V) kept slots
    first = e_NK[:, 0]
    first_EV = joint_counts(first[first >= 0], ids[first >= 0], E, V)
    first_E = first_EV.sum(1) / max(int(first_EV.sum()), 1)  # each expert's share of first choices
    occurrences_V = np.bincount(ids, minlength=V)
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
        row, total = assign_EV[e], int(assign_EV[e].sum())
        by_count = [v for v in np.argsort(-row, kind="stable")[:TOP] if row[v] > 0]
        eligible = np.nonzero(row >= max(min_support, 1))[0]
        owned = row[eligible] / occurrences_V[eligible]
        by_owned = eligible[np.lexsort((-row[eligible], -owned))][:TOP]  # the last key sorts first

        def stat(v: int, e: int = e, row: np.ndarray = row, total: int = total) -> TokenStat:
            return TokenStat(int(v), reader.text(int(v)), int(row[v]), float(lift_EV[e, v]),
                             reader.at(routes, li, e, int(v)), float(row[v] / max(total, 1)),
                             int(occurrences_V[v]), float(row[v] / occurrences_V[v]))

        mine = first == e
        experts_out.append(ExpertStat(
            e, total, int(first_EV[e].sum()), float(total / max(n_kept, 1)), float(kl_E[e]), float(kl_null_E[e]),
            float(shared[mine].mean()) if shared is not None and mine.any() else None,
            {n: float(class_EC[e, c] / max(total, 1)) for c, n in enumerate(names)},
            [stat(v) for v in by_count], [stat(v) for v in by_owned],
            float(n_kept / (K * total)) if total else 0.0, float(first_E[e] * kl_E[e]),
            float(first_E[e] * kl_null_E[e])))
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
    occ_V = np.bincount(routes.ids, minlength=V)
    p_V = occ_V / len(routes.ids)
    reader = _Contexts(tokenizer, routes.ids)
    top = []
    for p in np.argsort(-count_P, kind="stable")[:TOP_PATHS]:
        toks = np.bincount(routes.ids[label == p], minlength=V)
        best = [v for v in np.argsort(-toks, kind="stable")[:TOP] if toks[v] > 0]
        top.append(PathStat([int(e) for e in unique_PL[p]], int(count_P[p]), float(count_P[p] / len(routes.ids)),
                            [TokenStat(int(v), reader.text(int(v)), int(toks[v]),
                                       float(toks[v] / count_P[p] / p_V[v]), [], float(toks[v] / count_P[p]),
                                       int(occ_V[v]), float(toks[v] / occ_V[v])) for v in best]))
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
