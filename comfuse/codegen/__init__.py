"""Code generation (owns: kernel source text from a plan). ``triton/`` is portable and runs in
Triton's CPU interpreter; ``gluon/`` holds the warp-specialised sm_90 kernels; ``source``
what both share. Generated sources open with the IR they came from."""
