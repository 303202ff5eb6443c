"""Gluon templates (Triton 3.6's lower-level language, sm_90 only): kernels whose schedule
Triton's ``tl`` cannot express on Hopper, chiefly warp specialisation. They do not run in the
CPU interpreter; CI compiles them for sm_90 and the H200 checks them."""
