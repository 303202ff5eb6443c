"""Runtime (owns: compiled functions and their specialisations, the kernel source cache,
kernel build and launch, result checks, and ahead-of-time compilation for a GPU target).

Invariants: a call never reuses a kernel built for other shapes or dtypes; any failure
falls back to the region's original ops with a warning (COMFUSE_STRICT=1 raises).
"""
