"""Fusion Spec IR: the records a region is made of.

A region is one GEMM (the anchor) and the epilogue DAG that consumes its
accumulator. Its iteration space is (B, M, N): B batches of an M x N output
tile grid; K is the contraction length. Every value of the epilogue is a
broadcastable slice of that space, described by its ``axes`` (the subset of
{"B", "M", "N"} it may vary along): a full tile has {"M", "N"} (plus "B" when
batched), a row vector such as a bias has {"N"}, per-row statistics after a
reduction along N have {"M"}, a scalar has none.

Nodes are kept in SSA order: ``Node.src`` holds indices of earlier nodes, so
``Region.nodes`` is always topologically sorted. Records are frozen; passes
build new ones.

Numerics: floating-point nodes record the dtype eager PyTorch would give them,
but generated kernels compute every floating-point node in fp32 and round only
when an output is stored; a ``CAST`` between floating-point types does not
round inside the kernel (rounding some values but not the ones they meet
again, as in ``x - mean(x)``, would be less faithful, not more). The reference
interpreter's exact mode follows the same rule.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

AXES_ORDER = ("B", "M", "N")


class Op(enum.Enum):
    # leaves
    ACC = "acc"  # the GEMM accumulator tile (fp32); arg 1: the second product's (Gemm.b2)
    INPUT = "input"  # a side input; arg = index into Region.inputs
    CONST = "const"  # a Python scalar; arg = value
    IOTA = "iota"  # global index along one axis; arg = "M" or "N"
    STAT = "stat"  # a merged per-row statistic (one-pass form's combine step); arg = its index
    SHIFT = "shift"  # a per-row constant near a row's values (deferred chains); arg = statistic
    # elementwise, one source
    NEG = "neg"
    ABS = "abs"
    EXP = "exp"
    EXPM1 = "expm1"
    LOG = "log"
    LOG1P = "log1p"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    RECIPROCAL = "reciprocal"
    TANH = "tanh"
    SIGMOID = "sigmoid"
    ERF = "erf"
    RELU = "relu"
    SIN = "sin"
    COS = "cos"
    NOT = "not"
    POW = "pow"  # arg = constant exponent
    CAST = "cast"  # arg = target torch.dtype
    # elementwise, two sources
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    MAX = "max"
    MIN = "min"
    EQ = "eq"
    NE = "ne"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"
    AND = "and"
    OR = "or"
    # elementwise, three sources
    WHERE = "where"  # (condition, if_true, if_false)
    # reductions; arg = the reduced axis ("M" or "N"); the result keeps a size-1 axis
    SUM = "sum"
    RMAX = "rmax"
    RMIN = "rmin"


LEAF = frozenset({Op.ACC, Op.INPUT, Op.CONST, Op.IOTA, Op.STAT, Op.SHIFT})
UNARY = frozenset({Op.NEG, Op.ABS, Op.EXP, Op.EXPM1, Op.LOG, Op.LOG1P, Op.SQRT, Op.RSQRT,
                   Op.RECIPROCAL, Op.TANH, Op.SIGMOID, Op.ERF, Op.RELU, Op.SIN, Op.COS,
                   Op.NOT, Op.POW, Op.CAST})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX, Op.MIN, Op.EQ, Op.NE, Op.LT,
                    Op.LE, Op.GT, Op.GE, Op.AND, Op.OR})
COMPARE = frozenset({Op.EQ, Op.NE, Op.LT, Op.LE, Op.GT, Op.GE})
TERNARY = frozenset({Op.WHERE})
ELEMENTWISE = UNARY | BINARY | TERNARY
REDUCE = frozenset({Op.SUM, Op.RMAX, Op.RMIN})

ARITY = {**{op: 0 for op in LEAF}, **{op: 1 for op in UNARY}, **{op: 2 for op in BINARY},
         **{op: 3 for op in TERNARY}, **{op: 1 for op in REDUCE}}

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
GEMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def sort_axes(axes) -> tuple[str, ...]:
    return tuple(a for a in AXES_ORDER if a in axes)


def needed_by(nodes, roots) -> set:
    """The indices of ``nodes`` (SSA) that ``roots`` need, themselves included."""
    seen, todo = set(), list(roots)
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo += list(nodes[i].src)
    return seen


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    op: Op
    src: tuple[int, ...]
    dtype: torch.dtype
    axes: frozenset[str]
    arg: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class Operand:
    """A GEMM operand: A is [B?, M, K], B is [B?, K, N], any strides.

    ``major`` names the dimension with unit stride, when there is one: for A "K" (row
    major) or "M"; for B "N" (row major) or "K" (a transposed weight, as ``linear``
    passes it). Tensor-memory-accelerator loads need it; "" means neither."""
    name: str
    dtype: torch.dtype
    major: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Gemm:
    """The anchor's product A @ B, and optionally a second one, A @ B2, over the same A and the
    same output tiles (SwiGLU's up projection beside its gate projection: the two products meet
    in the epilogue, ``silu(g) * u``, and neither goes to memory unless an output needs it).
    The first product is the ``ACC`` node with no ``arg``, the second the one with ``arg`` 1.
    Wherever a region's tensors are passed as (A, B, side inputs), B2 (as [B?, K, N]) comes
    last among the side inputs: a kernel's and the reference interpreter's."""
    a: Operand
    b: Operand
    batched: bool
    out_dtype: torch.dtype  # dtype eager gives the product
    b2: Operand | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Input:
    """A side input (bias, residual, gamma, ...), viewed as a broadcast slice of (B, M, N)."""
    name: str
    dtype: torch.dtype
    axes: frozenset[str]


@dataclasses.dataclass(frozen=True, slots=True)
class Output:
    """A value the kernel writes. ``axes`` is the stored shape (may be wider than the node's)."""
    node: int
    dtype: torch.dtype
    axes: frozenset[str]
    name: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Sizes:
    B: int
    M: int
    N: int
    K: int

    def of(self, axis: str) -> int:
        return getattr(self, axis)


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    kind: str  # "gemm_epilogue" (a GEMM and the epilogue after it)
    gemm: Gemm
    inputs: tuple[Input, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[Output, ...]
    sizes: Sizes

    @property
    def tile_axes(self) -> frozenset[str]:
        return frozenset({"B", "M", "N"} if self.gemm.batched else {"M", "N"})

    @property
    def dual(self) -> bool:
        """Whether the region computes a second product over A (``Gemm.b2``)."""
        return self.gemm.b2 is not None

    @property
    def products(self) -> int:
        """How many products of A the region computes (each with its own B of K x N)."""
        return 2 if self.dual else 1

    def reductions(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.op in REDUCE]

    def replace(self, **changes) -> "Region":
        return dataclasses.replace(self, **changes)
