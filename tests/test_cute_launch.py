"""scripts/cute_launch.py: the parameter list of a CuTe DSL cubin read from its PTX, and the
bytes each parameter is given (the GPU machine launches such cubins without the DSL)."""
import importlib.util
import struct
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("cute_launch", Path(__file__).parents[1] / "scripts" / "cute_launch.py")
cute_launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cute_launch)

# the head of the fused GEMM + LayerNorm kernel's PTX (scripts/cute_ln_gemm.py), names shortened:
# two TMA descriptors, five tensors with static layouts, eps, the tiled MMA's accumulate flag
PTX = """
.visible .entry kernel_cutlass_kernel_0(
\t.param .align 64 .b8 kernel_cutlass_kernel_0_param_0[128],
\t.param .align 64 .b8 kernel_cutlass_kernel_0_param_1[128],
\t.param .align 8 .b8 kernel_cutlass_kernel_0_param_2[8],
\t.param .align 8 .b8 kernel_cutlass_kernel_0_param_3[8],
\t.param .align 8 .b8 kernel_cutlass_kernel_0_param_4[8],
\t.param .align 8 .b8 kernel_cutlass_kernel_0_param_5[8],
\t.param .align 8 .b8 kernel_cutlass_kernel_0_param_6[8],
\t.param .f32 kernel_cutlass_kernel_0_param_7,
\t.param .u64 .ptr .global .align 16 kernel_cutlass_kernel_0_param_8,
\t.param .u32 kernel_cutlass_kernel_0_param_9,
\t.param .align 1 .b8 kernel_cutlass_kernel_0_param_10[1]
)
.reqntid 384, 1, 1
"""


def test_the_parameter_list_is_read_from_the_ptx():
    entry, params = cute_launch.parse_ptx_params(PTX)
    assert entry == "kernel_cutlass_kernel_0"
    assert [p["size"] for p in params] == [128, 128, 8, 8, 8, 8, 8, 4, 8, 4, 1]
    assert [p["align"] for p in params[:3]] == [64, 64, 8]
    assert [p["type"] for p in params[7:10]] == ["f32", "u64", "u32"]


def test_scalars_pack_little_endian_to_their_parameter_sizes():
    assert cute_launch.u64(0x1122334455667788) == bytes.fromhex("8877665544332211")
    assert cute_launch.u32(-1) == b"\xff\xff\xff\xff"
    assert cute_launch.u8(1) == b"\x01"
    assert struct.unpack("<f", cute_launch.f32(1e-5))[0] == pytest.approx(1e-5)


def test_the_dsl_descriptor_model_puts_dims_strides_and_box_where_the_driver_does():
    """The DSL's packing of a rank-2 bf16 tensor map with 128-byte swizzle (read from its host
    IR), here for a 8192 x 1024 tensor, box 64 x 128. On the H200 (eleventh session, call 4)
    the driver's cuTensorMapEncodeTiled gave the same words 0 and 2-7 for the probe's
    tensors; word 1 differed in bits 1 and 21, and kernels loaded correctly with either."""
    addr = 0x7F0000000000
    w = cute_launch.dsl_pack_2d(addr, (1024, 8192), 2048, (64, 128), 2, 0x46512)
    assert w[0] == addr                           # 16-byte aligned address, as is
    assert w[1] >> 32 == 2048 // 16               # row stride in 16-byte units
    assert w[1] & (1 << 21)                       # tensors of >= 128 KiB keep bit 21
    assert w[4] == (1024 - 1) | ((8192 - 1) << 32)
    assert w[6] >> 56 == 64 - 1 and w[7] == 128 - 1
    small = cute_launch.dsl_pack_2d(addr, (64, 128), 128, (64, 128), 2, 0x46512)
    assert not small[1] & (1 << 21)
