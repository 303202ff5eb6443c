"""Fusion Spec IR (owns: the region records, their verifier, printer, structural key and
reference interpreter).

Invariants: records are frozen; nodes are in SSA order; every pass's output
passes ``verify``; ``interpret.evaluate`` defines what each op means.
"""
from .interpret import canonical_shape, evaluate, evaluate_by_rows, evaluate_with_scale, rows_independent
from .key import structural_key, structural_text
from .nodes import (AXES_ORDER, BINARY, COMPARE, ELEMENTWISE, FLOAT_DTYPES, GEMM_DTYPES, LEAF,
                    REDUCE, TERNARY, UNARY, Gemm, Input, Node, Op, Operand, Output, Region, Sizes,
                    needed_by, sort_axes)
from .printer import dtype_name, format_region
from .verify import IRError, verify

__all__ = [
    "AXES_ORDER", "BINARY", "COMPARE", "ELEMENTWISE", "FLOAT_DTYPES", "GEMM_DTYPES", "LEAF", "REDUCE",
    "TERNARY", "UNARY", "Gemm", "IRError", "Input", "Node", "Op", "Operand", "Output", "Region",
    "Sizes", "canonical_shape", "dtype_name", "evaluate", "evaluate_by_rows", "evaluate_with_scale", "format_region",
    "needed_by", "rows_independent", "sort_axes",
    "structural_key", "structural_text", "verify",
]
