"""The arithmetic of `nanollama4 experts`: lift, mutual information and its shuffle null, on label arrays.

Everything here reads plain integer arrays (one label per token: the token's id, its class, the expert it
went to first, its path through the layers) and knows nothing of models, so that a test can hand it a
routing it built and check each number against a hand computation.

Mutual information is the plug-in estimate from the joint counts, in bits. It is biased upward on a
finite sample (more so the more labels there are), which is why every MI is read against the *shuffle
null*: the same expert labels permuted across the same tokens, so that each expert keeps exactly its load
and each token its count, and only the pairing between them is random. "Specialised" means "above it".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# two-sided 95% Student t quantiles for 1..30 degrees of freedom (past 30, 1.96 is within 3%)
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def joint_counts(a: np.ndarray, b: np.ndarray, n_a: int, n_b: int) -> np.ndarray:
    """(n_a, n_b) counts of the pairs (a[i], b[i]): labels 0..n_a-1 and 0..n_b-1."""
    flat = a.astype(np.int64) * n_b + b.astype(np.int64)
    return np.bincount(flat, minlength=n_a * n_b).reshape(n_a, n_b)


def mutual_information(joint: np.ndarray) -> float:
    """I(A; B) in bits from a joint count table: sum over cells of p(a,b) log2 p(a,b) / (p(a) p(b))."""
    n = joint.sum()
    if n == 0:
        return 0.0
    p_ab = joint / n
    p_a, p_b = p_ab.sum(1, keepdims=True), p_ab.sum(0, keepdims=True)
    nz = p_ab > 0
    return max(0.0, float((p_ab[nz] * np.log2(p_ab[nz] / (p_a @ p_b)[nz])).sum()))  # >= 0, less the rounding


def kl_per_row(joint: np.ndarray) -> np.ndarray:
    """Per row a (an expert), D(P(b | a) || P(b)) in bits: how far its mix of tokens is from the stream's.
    Weighted by P(a), these sum to I(A; B), so each expert's number is its part of the layer's."""
    n = joint.sum()
    rows = joint.sum(1, keepdims=True)
    p_b = joint.sum(0, keepdims=True) / max(n, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        p_b_given_a = joint / np.maximum(rows, 1)
        terms = np.where(joint > 0, p_b_given_a * np.log2(p_b_given_a / p_b), 0.0)
    return terms.sum(1)


def lift(joint: np.ndarray) -> np.ndarray:
    """P(b | a) / P(b) per cell: how many times more often token b goes to expert a than its share of the
    stream would give (1 = no preference; 0 where the row is empty)."""
    rows = joint.sum(1, keepdims=True)
    p_b = joint.sum(0, keepdims=True) / max(joint.sum(), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (joint / np.maximum(rows, 1)) / p_b
    return np.nan_to_num(out, nan=0.0, posinf=0.0)


DENSE_CELLS = 2**24  # joint tables up to this many cells are counted densely; larger ones by their pairs seen


def mutual_information_of(a: np.ndarray, b: np.ndarray, n_a: int, n_b: int) -> float:
    """I(A; B) in bits of paired labels, the same number as `mutual_information(joint_counts(...))`, but
    counting only the pairs that occur when the table would be large (paths x a BPE vocabulary)."""
    if n_a * n_b <= DENSE_CELLS:
        return mutual_information(joint_counts(a, b, n_a, n_b))
    n = len(a)
    if n == 0:
        return 0.0
    a, b = a.astype(np.int64), b.astype(np.int64)
    pairs, counts = np.unique(a * n_b + b, return_counts=True)
    p_a, p_b = np.bincount(a, minlength=n_a) / n, np.bincount(b, minlength=n_b) / n
    p = counts / n
    return max(0.0, float((p * np.log2(p / (p_a[pairs // n_b] * p_b[pairs % n_b]))).sum()))


def shuffled(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The same labels in a random order over the same tokens: every label keeps exactly its count (each
    expert its load), and only which token got which is random."""
    return labels[rng.permutation(len(labels))]


@dataclass
class Specialisation:
    """Mutual information between a routing label (an expert, a path) and a token label (its id, its class),
    in bits, against the shuffle null, with an interval over chunks of the stream."""

    bits: float  # I(label; token) over the whole stream, plug-in estimate
    null_bits: float  # the mean of the same over `permutations` shuffles of the labels (each load kept)
    null_sd: float  # their standard deviation
    permutations: int
    excess_mean: float  # mean over chunks of (chunk MI - the chunk's shuffled MI): specialisation above chance
    excess_low: float | None  # its 95% t-interval over the chunks (None with fewer than two chunks)
    excess_high: float | None
    chunks: int
    label_bits: float = 0.0  # H(label) in bits over the same tokens: the most I(label; token) can be
    # bits - null_bits: the part of I(label; token) that chance would not give. The null grows with the number
    # of labels and of tokens (a finer MoE's is several times a coarser one's), so the raw bits of two layouts
    # do not compare; this does
    above_null: float = field(init=False)
    # above_null / H(label): the share of the routing's own information (at most log2 of the number of
    # experts) that the token accounts for beyond chance: 0 for routing that ignores the token, 1 for routing
    # the token decides entirely
    normalised: float = field(init=False)

    def __post_init__(self) -> None:
        self.above_null = self.bits - self.null_bits
        self.normalised = self.above_null / self.label_bits if self.label_bits > 0 else 0.0


def entropy_bits(labels: np.ndarray, n_labels: int) -> float:
    """H(label) in bits of labels 0..n_labels-1."""
    if len(labels) == 0:
        return 0.0
    p = np.bincount(labels.astype(np.int64), minlength=n_labels) / len(labels)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def t_interval(values: list[float]) -> tuple[float, float | None, float | None]:
    """Mean and 95% Student t-interval of the values (None, None for fewer than two)."""
    n = len(values)
    mean = float(np.mean(values)) if n else 0.0
    if n < 2:
        return mean, None, None
    half = (_T95[n - 2] if n - 1 <= len(_T95) else 1.96) * float(np.std(values, ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half


def specialisation(label: np.ndarray, token: np.ndarray, n_label: int, n_token: int, bounds: list[int],
                   permutations: int = 5, seed: int = 0) -> Specialisation:
    """I(label; token) for tokens labelled 0..n_label-1 (others, e.g. -1 for a dropped slot, left out), against
    `permutations` shuffles of the labels; and per chunk (tokens bounds[i]:bounds[i+1]) the MI less that
    chunk's shuffled MI, whose mean and interval say how sure the excess is."""
    rng = np.random.default_rng(seed)
    keep = label >= 0

    def mi(lab: np.ndarray, tok: np.ndarray) -> float:
        return mutual_information_of(lab, tok, n_label, n_token)

    lab, tok = label[keep], token[keep]
    nulls = [mi(shuffled(lab, rng), tok) for _ in range(permutations)]
    excess = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        k = keep[lo:hi]
        cl, ct = label[lo:hi][k], token[lo:hi][k]
        if len(cl):
            excess.append(mi(cl, ct) - mi(shuffled(cl, rng), ct))
    mean, low, high = t_interval(excess)
    return Specialisation(mi(lab, tok), float(np.mean(nulls)) if nulls else 0.0,
                          float(np.std(nulls)) if nulls else 0.0, permutations, mean, low, high, len(excess),
                          entropy_bits(lab, n_label))
