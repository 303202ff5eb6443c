"""Launch a CuTe-DSL-compiled cubin without the DSL (the DSL compiles sm_90a on the CPU machine;
its 63 MiB does not travel to the GPU one): load it, encode TMA descriptors, pack the
kernel parameters byte for byte from the PTX parameter list, launch with cuLaunchKernelEx.

Needs only the CUDA driver (libcuda.so.1), cuda-python (``cuda.bindings.driver``) and torch on
the GPU machine. ``encode_tiled`` calls ``cuTensorMapEncodeTiled`` through ctypes with a
64-byte-aligned output buffer (cuda-python's own wrapper writes into a Python object whose
storage is not 64-byte aligned: getPtr() % 64 == 48 in cuda-bindings 13.5.0; see
NVIDIA/cuda-python PR #1692 about the resulting crashes).
"""
from __future__ import annotations

import ctypes
import re
import struct

# CUtensorMapDataType (cuda.h)
DTYPE = {"uint8": 0, "uint16": 1, "uint32": 2, "int32": 3, "uint64": 4, "int64": 5, "float16": 6,
         "float32": 7, "float64": 8, "bfloat16": 9, "float32_ftz": 10, "tfloat32": 11, "tfloat32_ftz": 12}
ELEM_BYTES = {0: 1, 1: 2, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 4, 11: 4, 12: 4}
SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}       # bytes -> CUtensorMapSwizzle
L2_NONE, L2_64B, L2_128B, L2_256B = 0, 1, 2, 3
OOB_ZERO, OOB_NAN = 0, 1                      # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE / _NAN_REQUEST_ZERO_FMA

_libcuda = None


def libcuda():
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        f = _libcuda.cuTensorMapEncodeTiled
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                      ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return _libcuda


def driver_version() -> int:
    v = ctypes.c_int()
    assert libcuda().cuDriverGetVersion(ctypes.byref(v)) == 0
    return v.value


def encode_tiled(dtype: int, addr: int, dims: list[int], strides_bytes: list[int], box: list[int],
                 swizzle_bytes: int, l2: int = L2_128B, oob: int = OOB_ZERO,
                 elem_strides: list[int] | None = None, small_tensor_fix: bool = True) -> bytes:
    """cuTensorMapEncodeTiled -> the 128 descriptor bytes.

    dims, box, elem_strides: innermost (contiguous) dimension first, in elements.
    strides_bytes: byte strides of dims 1..rank-1 (rank-1 values, each a multiple of 16).
    Defaults = what CuTe DSL 4.8.1 / CUTLASS make_tma_copy_desc use: interleave none,
    L2 promotion 128B, OOB fill none (zeros), element strides 1.
    small_tensor_fix: CUTLASS 4.3.4+ and the DSL clear bit 21 of word 1 when the tensor spans
    < 128 KiB and the driver is <= 13.1 ("work around a driver bug which will cause occasionally
    errors when executing kernels").
    """
    rank = len(dims)
    assert len(strides_bytes) == rank - 1 and len(box) == rank
    assert addr % 16 == 0 and all(s % 16 == 0 for s in strides_bytes)
    elem_strides = elem_strides or [1] * rank
    raw = ctypes.create_string_buffer(128 + 64)
    out = (ctypes.addressof(raw) + 63) & ~63
    err = libcuda().cuTensorMapEncodeTiled(
        ctypes.c_void_p(out), dtype, rank, ctypes.c_void_p(addr),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * max(rank - 1, 1))(*(strides_bytes or [0])),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*elem_strides),
        0, SWIZZLE[swizzle_bytes], l2, oob)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: CUresult {err} (dims={dims}, strides={strides_bytes}, box={box})")
    words = list(struct.unpack_from("<16Q", ctypes.string_at(out, 128)))
    if small_tensor_fix and l2 != L2_NONE:
        extent = sum((d - 1) * s for d, s in zip(dims[1:], strides_bytes)) + dims[0] * ELEM_BYTES[dtype]
        if extent < 131072 and driver_version() <= 13010:
            words[1] &= ~(1 << 21)
    return struct.pack("<16Q", *words)


def parse_ptx_params(ptx: str) -> tuple[str, list[dict]]:
    """(entry name, [{'type','align','size'}]) of the first .entry in a PTX file."""
    m = re.search(r"\.visible \.entry (\w+)\(\s*(.*?)\)", ptx, re.S)
    entry, body = m.group(1), m.group(2)
    params = []
    for line in (x.strip() for x in body.split(",")):
        if not line:
            continue
        b = re.match(r"\.param \.align (\d+) \.b8 \w+\[(\d+)\]", line)
        if b:
            params.append({"type": "bytes", "align": int(b.group(1)), "size": int(b.group(2))})
            continue
        s = re.match(r"\.param \.(u64|s64|b64|u32|s32|b32|f32|f64|u16|b16|u8|b8)\b", line)
        size = {"64": 8, "32": 4, "16": 2, "8": 1}[re.sub(r"\D", "", s.group(1))]
        params.append({"type": s.group(1), "align": size, "size": size})
    return entry, params


def dsl_descriptor_words(host_ir: str) -> list[list]:
    """The 8 x 64-bit words the DSL's host code stores into each 64-byte-aligned i64[16]
    descriptor buffer (in order of appearance). Constant words as ints, computed ones as None."""
    fn = host_ir[host_ir.index("llvm.func @cutlass_host"):]
    fn = fn[:fn.index("\n  }\n")]
    consts = dict(re.findall(r"(%\d+) = llvm\.mlir\.constant\((-?\d+) : i64\)", fn))
    out = []
    for m in re.finditer(r"(%\d+) = llvm\.alloca %\d+ x i64 \{alignment = 64 : i64\}", fn):
        base = m.group(1)
        geps = dict(re.findall(r"(%\d+) = llvm\.getelementptr " + re.escape(base) + r"\[0, (\d+)\]", fn))
        words = {}
        for val, ptr in re.findall(r"llvm\.store (%\d+), (%\d+) : i64", fn):
            if ptr in geps:
                words[int(geps[ptr])] = int(consts[val]) if val in consts else None  # last store wins
        out.append([words.get(i) for i in range(8)])
    return out


def dsl_pack_2d(addr: int, dims: tuple[int, int], row_stride_bytes: int, box: tuple[int, int],
                elem_bytes: int, low32: int) -> list[int]:
    """The DSL 4.8.1 host packing of a rank-2 tiled CUtensorMap (first 64 bytes), as read from
    its LLVM IR. dims/box innermost first. ``low32``: the constant low half of word 1 (data type,
    rank, swizzle ...; 0x46512 for bf16 + SWIZZLE_128B). Words 8..15 are not written by the DSL."""
    extent = (dims[1] - 1) * row_stride_bytes + dims[0] * elem_bytes
    w = [0] * 8
    w[0] = ((addr // 16) & ((1 << 53) - 1)) << 4
    w[1] = (((row_stride_bytes // 16) << 32) & 0xFFFFFFFF00000000) | ((1 << 21) if extent >= 131072 else 0) | low32
    w[3] = ((row_stride_bytes >> 36) & 15) << 32
    w[4] = ((dims[0] - 1) & 0xFFFFFFFF) | ((dims[1] - 1) << 32)
    w[6] = (box[0] - 1) << 56
    w[7] = box[1] - 1
    return w


u64 = lambda v: (int(v) & (2**64 - 1)).to_bytes(8, "little")
u32 = lambda v: (int(v) & 0xFFFFFFFF).to_bytes(4, "little")
u8 = lambda v: (int(v) & 0xFF).to_bytes(1, "little")
f32 = lambda v: struct.pack("<f", v)


class Kernel:
    """A cubin entry launched with cuLaunchKernelEx from raw parameter bytes."""

    def __init__(self, cubin: bytes, entry: str, params: list[dict], smem: int):
        try:
            from cuda.bindings import driver as cu
        except ImportError:  # cuda-python < 12.6
            from cuda import cuda as cu
        self.cu, self.params, self.smem = cu, params, smem
        self.module = self._check(cu.cuModuleLoadData(cubin))
        self.fn = self._check(cu.cuModuleGetFunction(self.module, entry.encode()))
        if smem > 48 * 1024:   # the DSL's own loader sets MAX_DYNAMIC_SHARED_SIZE to the opt-in maximum
            self._check(cu.cuFuncSetAttribute(
                self.fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))

    @staticmethod
    def _check(result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver error {err}")
        return rest[0] if len(rest) == 1 else None

    def launch(self, blobs: list[bytes], grid, block, stream: int = 0, cluster=None) -> None:
        """blobs: one bytes object per PTX parameter, exactly that parameter's size."""
        cu = self.cu
        assert len(blobs) == len(self.params), (len(blobs), self.params)
        keep = []
        for blob, p in zip(blobs, self.params):
            assert len(blob) == p["size"], (p, len(blob))
            raw = ctypes.create_string_buffer(p["size"] + 64)     # 64-aligned copy of each value
            addr = (ctypes.addressof(raw) + 63) & ~63
            ctypes.memmove(addr, blob, p["size"])
            keep.append((raw, addr))
        ptrs = (ctypes.c_void_p * len(keep))(*[a for _, a in keep])
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (list(grid) + [1, 1])[:3]
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (list(block) + [1, 1])[:3]
        cfg.sharedMemBytes = self.smem
        cfg.hStream = cu.CUstream(stream)
        if cluster is not None:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = (list(cluster) + [1, 1])[:3]
            cfg.attrs, cfg.numAttrs = [attr], 1
        else:
            cfg.numAttrs = 0
        self._check(cu.cuLaunchKernelEx(cfg, self.fn, ctypes.addressof(ptrs), 0))
