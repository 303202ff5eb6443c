"""Triton device functions the generated kernels call.

Each one is written with operations that both the CUDA backend and Triton's CPU
interpreter implement (no libdevice), and keeps torch's NaN/Inf behaviour.
"""
import triton
import triton.language as tl


@triton.jit
def max_propagate_nan(a, b):
    """Combine for a max reduction: NaN wins, as in torch.amax. One ``max.NaN.f32`` per step
    at sm_90 (a compare-and-select form took four instructions: setp.gt, setp.nan, or, selp)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def min_propagate_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def tanh(x):
    # Small |x|: odd Taylor series (the exp form cancels there); large |x|: (1 - e) / (1 + e).
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    e = tl.exp(-2.0 * tl.abs(x))
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0, -big, big)
    return tl.where(tl.abs(x) < 0.1, series, big)


@triton.jit
def log1p(x):
    # Kahan: log(u) * x / (u - 1) with u = 1 + x corrects the rounding of u.
    u = 1.0 + x
    r = tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))
    return tl.where(u == float("inf"), u, r)


@triton.jit
def expm1(x):
    u = tl.exp(x)
    r = tl.where(u == 1.0, x, (u - 1.0) * (x / tl.log(u)))
    r = tl.where(u - 1.0 == -1.0, -1.0, r)
    return tl.where(u == float("inf"), u, r)


@triton.jit
def pow_real(x, c):
    """x ** c for a non-integer constant c: NaN for x < 0, as torch.pow."""
    return tl.exp2(c * tl.log2(x))


@triton.jit
def pow_int(x, n, ODD: tl.constexpr):
    """x ** n for a large integer constant n, keeping the sign of odd powers."""
    r = tl.exp2(n * tl.log2(tl.abs(x)))
    if ODD:
        r = tl.where(x < 0, -r, r)
    return r


@triton.jit
def strip_barrier(counter_ptr, members):
    """Wait until all ``members`` programs of a strip have arrived at this exchange.

    The counter only grows: arrival number ``old`` belongs to generation
    ``old // members``, which is complete once the counter reaches the next multiple of
    ``members``; no reset between exchanges or launches is needed. The release/acquire
    atomics order each program's published partials before its arrival, and the other
    programs' partials before the reads that follow. Co-residency of the members is the
    launcher's job (a persistent grid no larger than what the GPU holds at once).
    """
    strip_wait(counter_ptr, strip_arrive(counter_ptr, members))


@triton.jit
def strip_arrive(counter_ptr, members):
    """The arrival half of ``strip_barrier``: count this program in and return the value the
    counter reaches when its generation is complete (wait for it with ``strip_wait``). A
    program must not arrive at the next generation of the same counter before waiting for
    this one: ``old // members`` names the generation only while nobody runs a generation
    ahead (the overlapped strip alternates two counters for that reason)."""
    tl.debug_barrier()  # every warp has published its partials
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return (old // members + 1) * members


@triton.jit
def strip_wait(counter_ptr, target):
    """The waiting half of ``strip_barrier``: spin until the counter reaches ``target``."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def lse_merge(m1, s1, m2, s2):
    """Merge two log-sum-exp partials (running max, sum of exp(x - max)); a side whose max
    is -inf (nothing seen yet) contributes nothing instead of exp(-inf - -inf) = NaN."""
    m = tl.maximum(m1, m2, propagate_nan=tl.PropagateNan.ALL)
    f1 = tl.where(m1 == float("-inf"), 0.0, tl.exp(m1 - m))
    f2 = tl.where(m2 == float("-inf"), 0.0, tl.exp(m2 - m))
    return m, s1 * f1 + s2 * f2


@triton.jit
def moments_merge(n1, mean1, m2_1, n2, mean2, m2_2):
    """Chan et al.'s merge of (count, mean, sum of squared deviations): stable where
    E[x^2] - E[x]^2 would cancel."""
    n = n1 + n2
    d = mean2 - mean1
    w2 = tl.where(n > 0, n2 / tl.maximum(n, 1.0), 0.0)
    mean = mean1 + d * w2
    return n, mean, m2_1 + m2_2 + d * d * n1 * w2
