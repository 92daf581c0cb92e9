"""The registry of routed-expert products: what one is, how it registers, and which ones `auto` weighs.

A product multiplies rows sorted by expert, x_AD (A, D) with counts_E rows per expert, by the experts'
fused weights gate_up_EDH (E, D, 2H) and down_EHD (E, H, D), and returns SwiGLU_e(x_a) for each row,
(A, D). Every product computes that same function; they differ in speed by device, dtype and shape. Each
registers once (`register_product`), with what its callers need to know of it:

  supports       whether `auto` should consider it for rows like x (device, dtype, widths, row count,
                 compiling or not, what this machine has built); a product named outright runs anyway
  beats          the products it was measured faster than wherever both support the rows
  row_multiple   `FastExperts` pads each expert's group to a multiple of this many rows first (for speed:
                 the product still takes groups of any size)
  casts_weights  it takes the weights in their own dtype and casts what it multiplies (the others get
                 them cast to the rows' dtype)
  stages         its forward and backward as separate stages, for the routed layer's one node (`ops.routed`)

`auto` (`experts.auto_product`) takes the products that support the rows, drops each one another of them
beats, and where more than one is left times those on the shape, once per shape (`experts.faster_product`).
`PRODUCTS`, `ROW_MULTIPLE`, `CASTS_WEIGHTS` and `DISPATCH_NAMES` are read from the registry, never written
by hand. The built-in products register in ops/experts.py; one of your own is one call in a module of your
own, passed to any command with `--import`; from then on `FastExperts.dispatch` accepts its name and
`auto` times it against the built-in choice wherever it supports the rows:

    import torch
    from nanollama4.model.moe import per_expert_products
    from nanollama4.ops.products import register_product

    def float32_only(x, hidden, n_experts, rows):
        return x.dtype == torch.float32

    def my_product(x_AD, gate_up_EDH, down_EHD, counts_E, expert_A):
        return per_expert_products(x_AD, gate_up_EDH, down_EHD, counts_E)

    register_product("mine", my_product, supports=float32_only)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..base.errors import ConfigError
from ..base.parts import Registry
from .routed import Stages

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Supports = Callable[[torch.Tensor, int, int, int], bool]  # (rows like x, hidden, n_experts, rows) -> considered


def anywhere(x: torch.Tensor, hidden: int, n_experts: int, rows: int) -> bool:
    """Every input: the default `supports`, for a product that `auto` should weigh wherever it is asked."""
    return True


@dataclass(frozen=True)
class ExpertProduct:
    """One registered product (fields: see the module docstring)."""

    name: str
    fn: Product
    supports: Supports = anywhere
    beats: tuple[str, ...] = ()
    row_multiple: int = 1
    casts_weights: bool = False
    stages: Stages | None = None


REGISTRY: Registry[ExpertProduct] = Registry("dispatch", "a product", "nanollama4.ops.experts",
                                              changed=lambda: _derive())  # name -> product, in registration order
PRODUCTS: dict[str, Product] = {}  # name -> function; every call goes through here, so one entry swaps one product
ROW_MULTIPLE: dict[str, int] = {}  # the products that want each group padded, to a multiple of this
CASTS_WEIGHTS: set[str] = set()  # the products that take the weights in their own dtype
DISPATCH_NAMES: list[str] = ["auto"]  # what `FastExperts.dispatch` accepts
_ASKING: list[ExpertProduct] = []  # the registry in the order `contenders` asks it


def register_product(name: str, fn: Product, *, supports: Supports = anywhere, beats: tuple[str, ...] = (),
                     row_multiple: int = 1, casts_weights: bool = False, stages: Stages | None = None
                     ) -> ExpertProduct:
    """Add product `name` (or replace the one of that name, as a router kind's subclass does); returns it.

    The tables every caller reads are rebuilt from the registry here, so a product is this one call."""
    if name == "auto" or not name.isidentifier():
        raise ConfigError(f"a product's name must be an identifier other than 'auto', not {name!r}")
    if not isinstance(row_multiple, int) or row_multiple < 1:
        raise ConfigError(f"product {name!r}: row_multiple ({row_multiple!r}) must be a positive integer")
    if stages is not None:  # the routed node pads as the stepwise path does
        stages = dataclasses.replace(stages, multiple=row_multiple)
    beats = (beats,) if isinstance(beats, str) else tuple(beats)  # beats="loop" means the loop, not l, o, o, p
    product = ExpertProduct(name, fn, supports, beats, row_multiple, casts_weights, stages)
    REGISTRY.add(name, product)  # the tables below are derived again
    return product


def unregister_product(name: str) -> None:
    """Remove product `name` (a test's, or a module's that is being reloaded); a name not there is ignored."""
    REGISTRY.remove(name)


def _derive() -> None:
    """Refill the tables read per call from the registry, in place (modules that imported them keep them)."""
    PRODUCTS.clear()
    PRODUCTS.update((n, p.fn) for n, p in REGISTRY.items())
    ROW_MULTIPLE.clear()
    ROW_MULTIPLE.update((n, p.row_multiple) for n, p in REGISTRY.items() if p.row_multiple > 1)
    CASTS_WEIGHTS.clear()
    CASTS_WEIGHTS.update(n for n, p in REGISTRY.items() if p.casts_weights)
    DISPATCH_NAMES[:] = ["auto", *REGISTRY]
    waiting, _ASKING[:] = list(REGISTRY.values()), []
    while waiting:  # each product after every one that beats it; in a circle of beats, registration order
        ready = [p for p in waiting if not any(p.name in q.beats for q in waiting)] or waiting[:1]
        _ASKING.extend(ready)
        waiting = [p for p in waiting if p.name not in {r.name for r in ready}]


def check_dispatch(name: str) -> str:
    """`name` if it names a dispatch ("auto" or a product), else a ConfigError listing the valid ones."""
    if name not in DISPATCH_NAMES:
        raise ConfigError(f"unknown expert dispatch {name!r}; valid: {', '.join(DISPATCH_NAMES)}")
    return name


def contenders(x: torch.Tensor, hidden: int, n_experts: int, rows: int) -> list[str]:
    """The products `auto` weighs for `rows` rows like x, in registration order: those that support them,
    less each one another of them beats. Asked per call, so they are asked beaters first, and a product
    beaten by one already found to support the rows is not asked at all."""
    found: list[str] = []
    beaten: set[str] = set()
    for p in _ASKING:
        if p.name not in beaten and p.supports(x, hidden, n_experts, rows):
            found.append(p.name)
            beaten.update(p.beats)
    if not found:
        raise ConfigError(f"no expert product supports {x.dtype} rows on {x.device} of width {x.shape[-1]}; "
                          f"registered: {', '.join(REGISTRY)}")
    return found if len(found) == 1 else [name for name in REGISTRY if name in found]


def pad_groups(token_A: torch.Tensor, weight_A: torch.Tensor, expert_A: torch.Tensor, counts_E: torch.Tensor,
               multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Assignments sorted by expert, with each expert's group padded to a multiple of `multiple` rows.

    A padding row reads token 0 with weight 0, so it contributes nothing: with the weight on the input it
    multiplies zeros (SwiGLU(0) = 0); with the weight on the output its result is scaled to 0. Returns the
    padded token_P, weight_P (gradients reach only the real weights), counts_P and expert_P.
    """
    A, dev = token_A.shape[0], token_A.device
    padded_E = (counts_E + multiple - 1).div(multiple, rounding_mode="floor") * multiple
    slot_A = torch.arange(A, device=dev) - (torch.cumsum(counts_E, 0) - counts_E)[expert_A]
    row_A = (torch.cumsum(padded_E, 0) - padded_E)[expert_A] + slot_A  # each assignment's padded row
    P = int(padded_E.sum())
    source_P = torch.full((P,), A, dtype=torch.long, device=dev).index_copy_(0, row_A, torch.arange(A, device=dev))
    token_P = torch.cat([token_A, token_A.new_zeros(1)]).index_select(0, source_P)
    weight_P = torch.cat([weight_A, weight_A.new_zeros(1)]).index_select(0, source_P)
    expert_P = torch.repeat_interleave(torch.arange(counts_E.shape[0], device=dev), padded_E, output_size=P)
    return token_P, weight_P, padded_E, expert_P
