"""What the Triton and Gluon generators share: the source record, literals, operators, and
index arithmetic folded at generation time (no ``* 1`` or ``+ 0`` in a generated kernel)."""
from __future__ import annotations

import dataclasses
import math

from ..ir import Op

# the infix text of each binary op, in Triton and Gluon alike
INFIX = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.DIV: "/", Op.EQ: "==", Op.NE: "!=",
         Op.LT: "<", Op.LE: "<=", Op.GT: ">", Op.GE: ">=", Op.AND: "&", Op.OR: "|"}


@dataclasses.dataclass(frozen=True, slots=True)
class Param:
    """One runtime argument of a Triton kernel: role is a, b, in, out, size or stride."""
    name: str
    role: str
    index: int | None = None  # which side input / output
    axis: str | None = None  # for strides: B, M, N or K; for sizes: M, N or K


@dataclasses.dataclass(frozen=True, slots=True)
class KernelSource:
    name: str
    text: str
    params: tuple[Param, ...]
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int


def literal(value) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    return repr(int(value))


def docstring(name: str, describe: str, ir: str) -> list[str]:
    """The opening lines of a generated module: what it is and the IR (text) it came from."""
    return [f'"""comfuse kernel {name}: {describe}', "",
            "Generated from this IR (do not edit; regenerated when anything below changes):", "",
            ir, '"""']


def times(x: str, k) -> str:
    """``x * k`` with k = 1 and k = 0 folded (``x`` parenthesised where it is a sum)."""
    if k == 0 or x == "0":
        return "0"
    if k == 1:
        return x
    if x == "1":
        return str(k)
    return f"({x}) * {k}" if (" + " in x or " - " in x) else f"{x} * {k}"


def plus(x: str, c) -> str:
    """``x + c`` with c = 0 folded."""
    if c == 0:
        return x
    return str(c) if x == "0" else f"{x} + {c}"


def paren(x: str) -> str:
    """``x`` parenthesised where it is more than one term (a name, a call, an index stay bare)."""
    depth = 0
    for ch in x:
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == " " and depth == 0:
            return f"({x})"
    return x


def import_line(module: str, names) -> list[str]:
    """``from module import a, b, ...`` wrapped under 120 columns."""
    line = f"from {module} import {', '.join(names)}"
    if len(line) <= 120:
        return [line]
    out, current = [], f"from {module} import ("
    for name in names:
        piece = f"{name}, "
        if len(current) + len(piece) > 118:
            out.append(current.rstrip())
            current = " " * len(f"from {module} import (")
        current += piece
    return out + [current.rstrip().rstrip(",") + ")"]


def flat_index(first: str, *dims) -> str:
    """The row-major index of ``first`` followed by (index, extent) pairs:
    ``((first * n1 + i1) * n2 + i2) ...`` with the products by 1 and sums of 0 folded."""
    expr = first
    for index, extent in dims:
        expr = plus(times(expr, extent), index)
    return expr
