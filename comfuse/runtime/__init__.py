"""Runtime (owns: the kernel source and decision cache, building a plan's kernel, launching it,
the modules that run a fused region or chain inside a captured graph, autotuning, result
checks, the CPU emulation of the Gluon kernels, ahead-of-time compilation for sm_90).

Modules, from the bottom up: ``cache``, ``launch`` (where kernels run, cheap launches),
``check`` (tolerances), ``timing``, ``kernel`` (Triton plans), ``strip_kernel`` and
``stages_kernel`` (Gluon plans), ``build`` (plan -> kernel), ``chain`` (back-to-back chains),
``tuning``, ``fused`` and ``region`` (the modules in the graph), ``emulate`` /
``emulate_gluon``, ``aot``.

Invariants: a call never reuses a kernel built for other shapes or dtypes; any failure falls
back to the region's original ops with a warning (COMFUSE_STRICT=1 raises).
"""
