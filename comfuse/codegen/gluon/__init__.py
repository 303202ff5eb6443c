"""Gluon kernels (Triton 3.6's lower-level language, sm_90 only): kernels whose schedule Triton's
``tl`` cannot express on Hopper, chiefly warp specialisation. ``parts`` holds the device
functions they share (the mainloop, the hand-off, fast math); ``strip`` is the hand-written
template; ``stages`` and ``values`` generate a kernel from a region's stages. They do not run
in the CPU interpreter: CI compiles them for sm_90 and runs their bodies in an emulation
(runtime/emulate.py); the H200 checks them."""
