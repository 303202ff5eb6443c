"""Code generation (owns: kernel source text). ``triton/`` is portable and runs in the CPU
interpreter; Hopper-specific back ends (clusters, DSMEM) will sit beside it."""
