"""Gluon, emulated on the CPU: the stand-ins of ``gl``, ``mbarrier`` and ``tma`` that the
warp-specialised kernels' own Python bodies run over (runtime/emulate.py runs plans with them).

Each program of the persistent grid is a Python thread, and so is each of its partitions
(``gl.warp_specialize``); a partition's values are whole [rows, columns] tensors (layouts do not
matter: all of a group's threads compute at once, so ``gl.thread_barrier`` is a no-op); shared
memory and global memory are torch tensors; mbarriers count arrivals and phases;
``gl.atomic_add`` is atomic under a lock, and a spin loop's polls yield, so all programs of a
strip run at once, as the persistent grid's co-residency guarantees. The mainloop partition and
the residual's TMA load (parts.py's ``mma_partition`` and ``load_residual``) are replaced by the
fp32 product of A and B handed off in bf16 (``module_env``).
"""
from __future__ import annotations

import threading
import time
import types

import torch

from ..codegen.gluon import parts

BM, BN = parts.BM, parts.BN


class Ptr:
    """A pointer into a flat tensor, ``ptr + offsets`` as in Gluon: the offsets an int or a
    tensor of them."""

    def __init__(self, base: torch.Tensor, offset=0):
        self.base, self.offset = base, offset
        self.dtype = types.SimpleNamespace(element_ty=base.dtype)

    def __add__(self, other):
        return Ptr(self.base, self.offset + other)

    __radd__ = __add__

    def index(self):
        off = self.offset
        return off if isinstance(off, torch.Tensor) else torch.tensor(off)


class _Smem:
    """A shared-memory buffer or a view of one: ``slice``, ``index``, ``load``, ``store``, and
    ``_reinterpret`` for the views the generated kernels take: the tile's pieces
    (``_Pieces``), the statistics by chunk, a tile in the B operand's ring."""

    layout = None

    def __init__(self, t: torch.Tensor):
        self.t = t

    @property
    def shape(self):
        return list(self.t.shape)

    def _reinterpret(self, dtype, shape, layout=None):
        shape = [int(v) for v in shape]
        if len(shape) == 3 and self.t.dim() == 2:  # strip.chunk_view: [pieces * chunks, CHUNK, 64]
            return _Pieces(self.t, shape)
        if len(shape) == 2 and self.t.is_contiguous() and self.t.numel() >= shape[0] * shape[1] \
                and dtype == self.t.dtype:  # the statistics' rows a chunk at a time; a tile in the B ring
            return _Smem(self.t.view(-1)[:shape[0] * shape[1]].view(shape))
        raise NotImplementedError(f"emulate: a {list(self.t.shape)} buffer as {shape}")

    def slice(self, start, size, dim=0):
        return _Smem(self.t.narrow(dim, int(start), int(size)))

    def index(self, i):
        return _Smem(self.t[int(i)])

    def load(self, layout=None):
        return self.t.clone()

    def store(self, value):
        self.t.copy_(torch.as_tensor(value).to(self.t.dtype).expand_as(self.t))


class _Pieces(_Smem):
    """strip.chunk_view over a [BM, BN] tile: piece b * (BM / CHUNK) + c is rows [c * CHUNK,
    (c + 1) * CHUNK) of columns [64 b, 64 b + 64), a view of the tile (the bytes the NVMMA
    layout puts there on the GPU, strip.PIECE)."""

    def __init__(self, tile: torch.Tensor, shape):
        self.tile, self._shape = tile, shape
        self.t = None

    @property
    def shape(self):
        return list(self._shape)

    def index(self, i):
        chunks = self.tile.shape[0] // self._shape[1]
        b, c = divmod(int(i), chunks)
        rows, cols = self._shape[1], self._shape[2]
        return _Smem(self.tile[c * rows:(c + 1) * rows, b * cols:(b + 1) * cols])


def _tensor(x, like=None):
    """A Python scalar as a tensor of ``like``'s dtype (a float with an int tensor: float32), or
    int64 / float32 beside another scalar."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(like, torch.Tensor) and not (isinstance(x, float) and not like.is_floating_point()):
        return torch.tensor(x, dtype=like.dtype)
    return torch.tensor(x, dtype=torch.int64 if isinstance(x, (bool, int)) else torch.float32)


class _Gl:
    """The part of ``triton.experimental.gluon.language`` the kernels use (``_module_env`` adds
    the program ids, allocation and ``warp_specialize``)."""

    float32, bfloat16, float16, int32, int64 = torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64
    constexpr = object

    def __init__(self, lock: threading.Lock, cancelled: threading.Event):
        self._lock, self._cancelled = lock, cancelled

    @staticmethod
    def BlockedLayout(*args, **kwargs):  # noqa: N802 - Gluon's name
        return None

    @staticmethod
    def SliceLayout(*args, **kwargs):  # noqa: N802 - Gluon's name
        return None

    @staticmethod
    def static_range(*args):
        return range(*(int(a) for a in args))

    @staticmethod
    def arange(start, end, layout=None):
        return torch.arange(int(start), int(end))

    @staticmethod
    def full(shape, value, dtype, layout=None):
        return torch.full([int(s) for s in shape], value, dtype=dtype)

    @staticmethod
    def load(ptr: Ptr, mask=None, other=None, cache_modifier=None):
        idx = ptr.index()
        if mask is None:
            return ptr.base[idx]
        mask = torch.as_tensor(mask).expand(idx.shape) if idx.dim() else torch.as_tensor(mask)
        vals = ptr.base[torch.where(mask, idx, torch.zeros_like(idx))]
        return torch.where(mask, vals, torch.as_tensor(0 if other is None else other, dtype=vals.dtype))

    @staticmethod
    def store(ptr: Ptr, value, mask=None):
        idx = ptr.index()
        value = torch.as_tensor(value).to(ptr.base.dtype).expand(idx.shape)
        if mask is not None:
            keep = torch.as_tensor(mask).expand(idx.shape)
            idx, value = idx[keep], value[keep]
        ptr.base[idx] = value

    def atomic_add(self, ptr: Ptr, value, sem=None, scope=None):
        if not value:  # a poll: let the other groups of the strip run
            if self._cancelled.is_set():
                raise Cancelled()
            time.sleep(1e-4)
        with self._lock:
            i = int(ptr.offset)
            old = int(ptr.base[i])
            ptr.base[i] = old + int(value)
        return old

    @staticmethod
    def join(a, b):
        return torch.stack([a, b], dim=-1)

    @staticmethod
    def split(x):
        return x[..., 0], x[..., 1]

    @staticmethod
    def permute(x, dims):
        return x.permute(*[int(d) for d in dims])

    @staticmethod
    def reshape(x, shape):
        return x.reshape([int(v) for v in shape])

    @staticmethod
    def convert_layout(x, layout=None):
        return x

    @staticmethod
    def thread_barrier():
        """Nothing to wait for: a partition's values here are whole tensors, computed at once."""

    @staticmethod
    def sum(x, axis):
        return x.sum(dim=axis)

    @staticmethod
    def max(x, axis):
        return x.amax(dim=axis)

    @staticmethod
    def min(x, axis):
        return x.amin(dim=axis)

    @staticmethod
    def maximum(x, y):
        return torch.maximum(_tensor(x, y), _tensor(y, x))

    @staticmethod
    def minimum(x, y):
        return torch.minimum(_tensor(x, y), _tensor(y, x))

    @staticmethod
    def where(c, x, y):
        return torch.where(torch.as_tensor(c), _tensor(x, y), _tensor(y, x))

    exp, log, sqrt, rsqrt = staticmethod(torch.exp), staticmethod(torch.log), staticmethod(torch.sqrt), \
        staticmethod(torch.rsqrt)
    abs, erf, sin, cos = staticmethod(torch.abs), staticmethod(torch.erf), staticmethod(torch.sin), \
        staticmethod(torch.cos)


class _Tma:
    """``tma.async_copy_shared_to_global`` (the output tile by one TMA store, clipped at the
    tensor's edges as TMA clips it): the descriptor is the [M, N] output itself."""

    @staticmethod
    def async_copy_shared_to_global(desc, coords, smem: _Smem):
        r, c = (int(v) for v in coords)
        dst = desc.t[r:r + smem.t.shape[0], c:c + smem.t.shape[1]]  # (clipped at the tensor's edges)
        dst.copy_(smem.t[:dst.shape[0], :dst.shape[1]].to(desc.t.dtype))

    @staticmethod
    def store_wait(n):
        """Nothing to wait for: the copy above is synchronous."""


class Cancelled(Exception):
    """A launch given up (it did not finish in time): each waiting thread leaves."""


class _Barriers:
    """mbarriers by their shared-memory address: ``init(count)``, ``arrive``, and ``wait(phase)``
    returning once that phase has completed (the phase now running has the other parity)."""

    def __init__(self, cancelled: threading.Event):
        self.state, self.cond, self.cancelled = {}, threading.Condition(), cancelled

    def init(self, bar: _Smem, count=1):
        with self.cond:
            self.state[bar.t.data_ptr()] = [int(count), 0, 0]  # (count, arrivals, phases done)

    def arrive(self, bar: _Smem, count=1, pred=True):
        if not pred:
            return
        with self.cond:
            st = self.state[bar.t.data_ptr()]
            st[1] += count
            if st[1] >= st[0]:
                st[1], st[2] = 0, st[2] + 1
                self.cond.notify_all()

    def wait(self, bar: _Smem, phase, deps=None):
        key = bar.t.data_ptr()
        with self.cond:
            while not self.cond.wait_for(lambda: self.state[key][2] % 2 != int(phase) % 2, timeout=0.05):
                if self.cancelled.is_set():
                    raise Cancelled()


class Desc:
    """A TMA descriptor stand-in: the whole tensor it covers, its block shape."""

    def __init__(self, t: torch.Tensor, block):
        self.t, self.dtype, self.layout = t, t.dtype, None
        self.block_type = types.SimpleNamespace(shape=list(block), nbytes=t.element_size() * block[0] * block[1])


class _Program(threading.local):
    pid = 0
    programs = 1


class Emulation:
    """One launch's machinery: the lock, the cancel flag, the ``gl`` stand-in, the barriers and
    each thread's program id."""

    def __init__(self):
        self.lock, self.cancelled = threading.Lock(), threading.Event()
        self.gl, self.bars, self.prog = _Gl(self.lock, self.cancelled), _Barriers(self.cancelled), _Program()


def _tile_coords(t, num_tiles, TILES_N, GROUP_M):
    """(row block, column tile) of tile t, as parts.tile_coords orders them (the stand-in
    mainloop's own copy: a disagreement with the epilogue's shows as wrong results)."""
    if GROUP_M == 0:
        return t // TILES_N, t % TILES_N
    per_group = GROUP_M * TILES_N
    first = (t // per_group) * GROUP_M
    rows = min(num_tiles // TILES_N - first, GROUP_M)
    return first + (t % per_group) % rows, (t % per_group) // rows


STANDINS = ("mma_partition", "load_residual", "exp_fast", "exp2_fast", "tanh_fast", "bf16_pairs")


def module_env(module, em: Emulation):
    """The module's globals with Gluon bound to the emulation and its gluon.jit functions
    rebound over them, but for the shared mainloop partition and residual load (``STANDINS``,
    parts.py's): the mainloop hands off each tile of the fp32 product of A and B (from their
    descriptors), adding the buffer's residual first where it holds one (RES 2), in bf16."""
    gl, bars, prog = em.gl, em.bars, em.prog
    products = {}

    def mma_partition(a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, tile_ready, tile_free, num_tiles, k_steps,
                      RES, B_KMAJOR, TILES_N, GROUP_M, BM, BN, BK, num_warps, spare_smem, spare_ready, SPARE):
        key = (id(a_desc), id(b_desc))
        with em.lock:
            if key not in products:
                b = b_desc.t.float()
                products[key] = a_desc.t.float() @ (b.t() if B_KMAJOR else b)
        acc = products[key]
        mine = range(prog.pid, int(num_tiles), prog.programs)
        for n, t in enumerate(mine):
            pid_m, pid_n = _tile_coords(t, int(num_tiles), TILES_N, GROUP_M)
            tile = acc[pid_m * BM:(pid_m + 1) * BM, pid_n * BN:(pid_n + 1) * BN]
            tile = torch.nn.functional.pad(tile, (0, BN - tile.shape[1]))  # (TMA: zeros past the edge)
            if SPARE and n == len(mine) - 1:  # the last tile into the ring, the buffer not waited for
                spare_smem.store(tile.to(torch.bfloat16))
                bars.arrive(spare_ready)
                continue
            if RES == 2:  # the buffer holds this tile's residual
                bars.wait(tile_free, n & 1)
                tile = tile + tile_smem.t.float()
            else:
                bars.wait(tile_free, (n & 1) ^ 1)
            tile_smem.store(tile.to(torch.bfloat16))
            bars.arrive(tile_ready)

    def load_residual(r_desc, tile_smem, bar, t, num_tiles, TILES_N, BM, BN):
        if int(t) < int(num_tiles):
            r, c = (int(t) // TILES_N) * BM, (int(t) % TILES_N) * BN
            tile_smem.store(r_desc.t[r:r + BM, c:c + BN])
            bars.arrive(bar)

    def warp_specialize(partitions, worker_warps, worker_regs):
        pid, programs, errors = prog.pid, prog.programs, []

        def start(fn, args):
            prog.pid, prog.programs = pid, programs
            try:
                fn(*args)
            except BaseException as e:  # (raised in the program's thread; the other partition leaves)
                errors.append(e)
                em.cancelled.set()
        threads = [threading.Thread(target=start, args=part, daemon=True) for part in partitions]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]

    def rebind(f):  # a gluon.jit function of the module: its Python body, over the emulation
        raw = f.fn
        return types.FunctionType(raw.__code__, env, raw.__name__, raw.__defaults__, raw.__closure__)

    gl.program_id = lambda axis: torch.tensor(prog.pid)
    gl.num_programs = lambda axis: torch.tensor(prog.programs)
    gl.cdiv = lambda a, b: (a + b - 1) // b
    gl.allocate_shared_memory = lambda dtype, shape, layout=None: _Smem(torch.zeros([int(v) for v in shape],
                                                                                     dtype=dtype))
    gl.zeros = lambda shape, dtype, layout=None: torch.zeros([int(v) for v in shape], dtype=dtype)
    gl.SwizzledSharedLayout = gl.BlockedLayout
    gl.warp_specialize = warp_specialize
    env = dict(vars(module))
    for key, value in vars(module).items():  # (the module's own and those it imports from parts.py)
        if hasattr(value, "fn") and key not in STANDINS:
            env[key] = rebind(value)
    env.update(gl=gl, tma=_Tma, fence_async_shared=lambda: None,
               mbarrier=types.SimpleNamespace(init=bars.init, arrive=bars.arrive, wait=bars.wait,
                                              expect=lambda *a, **k: None, MBarrierLayout=lambda: None),
               exp_fast=torch.exp, exp2_fast=torch.exp2, tanh_fast=torch.tanh,
               bf16_pairs=lambda x: x.to(torch.bfloat16),
               mma_partition=mma_partition, load_residual=load_residual, LOG2E=1.4426950408889634,
               PIECE=int(parts.PIECE))  # (parts.py's constants its rebound helpers read)
    return env


def launch(em: Emulation, kernel, args, options, programs: int, timeout: float) -> None:
    """One launch: each program a thread (all at once, as the persistent grid's co-residency
    has them); the first error raised once all have stopped."""
    errors = []
    em.cancelled.clear()

    def program(pid):
        em.prog.pid, em.prog.programs = pid, programs
        try:
            kernel(*args, **options)
        except BaseException as e:  # (reported after the join; the other programs given up)
            errors.append(e)
            em.cancelled.set()
    threads = [threading.Thread(target=program, args=(p, ), daemon=True) for p in range(programs)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(timeout=max(deadline - time.monotonic(), 0.0))
    hung = any(th.is_alive() for th in threads)
    em.cancelled.set()  # (the threads still waiting leave)
    for th in threads:
        th.join()
    if hung:
        raise RuntimeError("emulate.run: the launch did not finish (an exchange or a barrier waits forever)")
    errors = [e for e in errors if not isinstance(e, Cancelled)] or errors
    if errors:
        raise errors[0]


