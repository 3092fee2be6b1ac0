"""A CPU emulator for the CUDA backend's kernels, so its logic is tested without a GPU.

llmtune/backends/cuda/'s kernel source (runtime.kernel_source: every section's .cu) is compiled with g++ against a
small header that
provides CUDA's builtins: every CUDA thread of a block is a fiber (ucontext, switched with setjmp), __syncthreads and
__shfl_xor_sync are barriers the fibers meet at (in shuffled or random-priority order, so
ordering assumptions and shared-memory races show up), shared memory is static storage, blocks run one after another. A
barrier that can
never complete (divergent __syncthreads) is reported instead of hanging. Launch arguments are
checked against the kernel's C parameter types (pointer vs scalar, float vs int, width), which
is exactly what cupy passes unchecked.

`EmuRuntime` plugs into `CUDABackend(dtype, runtime=EmuRuntime())`: numpy plays cupy, and
`gemm` executes cublas<t>gemmStridedBatched's column-major contract literally on raw pointers,
so the backend's matmul planning is tested too. Only cupy glue (ufuncs, copies) is not
exercised, since numpy stands in for it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from llmtune.backends import cuda

EMU_HEADER = r"""
#include <setjmp.h>
#include <ucontext.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using std::cos; using std::exp; using std::fmax; using std::isnan; using std::log; using std::max; using std::min;
using std::pow; using std::sin; using std::sqrt; using std::tanh;

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static

static inline float __int_as_float(int bits) { float f; std::memcpy(&f, &bits, 4); return f; }
static inline float __int_as_float(unsigned bits) { float f; std::memcpy(&f, &bits, 4); return f; }
static inline float __uint_as_float(unsigned bits) { float f; std::memcpy(&f, &bits, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned bits; std::memcpy(&bits, &f, 4); return bits; }

namespace emu {
struct Barrier { int expected = 0, arrived = 0; std::vector<int> waiters; };
struct Fiber {
    ucontext_t ctx; jmp_buf jb; uint3 tid; int linear = 0; bool done = false, runnable = true, started = false;
};

static std::vector<Fiber> fibers;
static std::vector<std::vector<char>> stacks;
static Barrier block_barrier;
static std::vector<Barrier> warp_barriers;
static std::vector<std::vector<unsigned char>> exchange;  // per warp: 32 lanes x 8 bytes
static jmp_buf scheduler;
static int current = -1;
static void (*entry)(void**) = nullptr;
static void** entry_args = nullptr;
static std::string error;
static std::mt19937 rng(1234);
static const size_t kStack = 64 * 1024;

static void release(Barrier& b) {
    for (int w : b.waiters) fibers[w].runnable = true;
    b.waiters.clear();
    b.arrived = 0;
}

// Arrive and yield; the barrier releases everyone (this fiber too) when the last one arrives.
static void wait(Barrier& b) {
    b.waiters.push_back(current);
    fibers[current].runnable = false;
    if (++b.arrived == b.expected) release(b);
    if (!_setjmp(fibers[current].jb)) _longjmp(scheduler, 1);
}

static void fail(const std::string& msg) {
    if (error.empty()) error = msg;
    fibers[current].done = true;  // never resumed again
    _longjmp(scheduler, 1);
}

// An exited thread no longer counts at barriers (as on the hardware).
static void leave(Barrier& b) {
    b.expected--;
    if (b.arrived > 0 && b.arrived == b.expected) release(b);
}

static void trampoline() {
    entry(entry_args);
    Fiber& f = fibers[current];
    f.done = true;
    leave(block_barrier);
    leave(warp_barriers[f.linear / 32]);
    _longjmp(scheduler, 1);
}
}  // namespace emu

static inline void __syncthreads() { emu::wait(emu::block_barrier); }

template <class T>
static T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    const int linear = emu::fibers[emu::current].linear, warp = linear / 32, lane = linear % 32;
    const int width = std::min(32, (int)(blockDim.x * blockDim.y * blockDim.z) - warp * 32);
    if (mask != 0xffffffffu || width != 32 || (lane ^ lane_mask) >= width)
        emu::fail("__shfl_xor_sync needs a full warp and a full mask");
    unsigned char* slots = emu::exchange[warp].data();
    std::memcpy(slots + 8 * lane, &v, sizeof(T));
    emu::wait(emu::warp_barriers[warp]);
    T r;
    std::memcpy(&r, slots + 8 * (lane ^ lane_mask), sizeof(T));
    emu::wait(emu::warp_barriers[warp]);
    return r;
}

template <class T>
static T atomicAdd(T* address, T v) { T old = *address; *address = old + v; return old; }
"""

EMU_FOOTER = r"""
namespace emu {
template <class... A, std::size_t... I>
static void invoke_impl(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <class... A>
static void invoke(void (*k)(A...), void** args) { invoke_impl(k, args, std::index_sequence_for<A...>{}); }

// Parameter signature: per parameter 'p' + pointee kind/size or 's' + scalar kind/size, e.g. "pf4 si4".
template <class T> static std::string describe() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) {
        using P = std::remove_cv_t<std::remove_pointer_t<U>>;
        return std::string("p") + (std::is_floating_point_v<P> ? "f" : "i") + std::to_string(sizeof(P));
    } else {
        return std::string("s") + (std::is_floating_point_v<U> ? "f" : "i") + std::to_string(sizeof(U));
    }
}
template <class... A> static std::string signature(void (*)(A...)) {
    std::string s;
    ((s += describe<A>() + " "), ...);
    return s;
}

struct Entry { const char* name; void (*run)(void**); std::string sig; };
static std::vector<Entry>& table();
}  // namespace emu

static std::string emu_last_error;

extern "C" const char* emu_error() { return emu_last_error.c_str(); }

extern "C" const char* emu_signature(const char* name) {
    for (auto& e : emu::table()) if (!std::strcmp(e.name, name)) return e.sig.c_str();
    return nullptr;
}

extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, void** args) {
    using namespace emu;
    emu_last_error.clear();
    const Entry* e = nullptr;
    for (auto& t : table()) if (!std::strcmp(t.name, name)) e = &t;
    if (!e) { emu_last_error = std::string("no kernel ") + name; return 1; }
    const int n = (int)(bx * by * bz);
    if (n < 1 || n > 1024 || bx > 1024 || by > 1024 || bz > 64
        || gx < 1 || gy < 1 || gz < 1 || gy > 65535 || gz > 65535) {
        emu_last_error = "invalid launch configuration";
        return 1;
    }
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    entry = e->run;
    entry_args = args;
    error.clear();
    fibers.assign(n, Fiber());
    if ((int)stacks.size() < n) stacks.resize(n, std::vector<char>(kStack));
    const int n_warps = (n + 31) / 32;
    std::vector<int> order(n);
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        block_barrier = Barrier();
        block_barrier.expected = n;
        warp_barriers.assign(n_warps, Barrier());
        exchange.assign(n_warps, std::vector<unsigned char>(32 * 8));
        for (int w = 0; w < n_warps; ++w) warp_barriers[w].expected = std::min(32, n - 32 * w);
        for (int i = 0; i < n; ++i) {
            Fiber& f = fibers[i];
            f = Fiber();
            f.linear = i;
            f.tid = {(unsigned)(i % bx), (unsigned)((i / bx) % by), (unsigned)(i / (bx * by))};
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = stacks[i].data();
            f.ctx.uc_stack.ss_size = kStack;
            f.ctx.uc_link = nullptr;
            makecontext(&f.ctx, trampoline, 0);
        }
        // Two interleavings, alternating by block: shuffled rounds (every runnable thread steps to its
        // next barrier), or strict random priorities (the lowest-priority threads lag as far behind as
        // the barriers allow, which exposes missing __syncthreads around shared-memory reuse).
        const bool by_priority = rng() & 1;
        std::vector<int> priority(n);
        for (int i = 0; i < n; ++i) priority[i] = i;
        std::shuffle(priority.begin(), priority.end(), rng);
        for (;;) {
            order.clear();
            for (int i : priority) if (!fibers[i].done && fibers[i].runnable) order.push_back(i);
            if (order.empty()) break;
            if (by_priority) order.resize(1);
            else std::shuffle(order.begin(), order.end(), rng);
            for (int i : order) {
                if (fibers[i].done || !fibers[i].runnable) continue;
                current = i;
                threadIdx = fibers[i].tid;
                if (!_setjmp(scheduler)) {  // ucontext only to enter a fiber; plain jumps to switch
                    if (!fibers[i].started) { fibers[i].started = true; setcontext(&fibers[i].ctx); }
                    _longjmp(fibers[i].jb, 1);
                }
                if (!error.empty()) { emu_last_error = error; return 1; }
            }
        }
        for (int i = 0; i < n; ++i) if (!fibers[i].done) {
            emu_last_error = "deadlock: threads wait at a barrier the others never reach";
            return 1;
        }
    }
    return 0;
}
"""

_SCALAR_CTYPES = {"sf4": ctypes.c_float, "sf8": ctypes.c_double, "si4": ctypes.c_int32, "si8": ctypes.c_int64}


def _kernel_names(source: str) -> list[str]:
    return re.findall(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(', source)


def emulator_source(dtype) -> str:
    source = cuda.kernel_source(dtype)
    entries = ",\n".join(f'{{"{n}", [](void** a) {{ invoke({n}, a); }}, signature({n})}}'
                         for n in _kernel_names(source))
    table = ("\nnamespace emu {\nstatic std::vector<Entry>& table() { static std::vector<Entry> t = {\n"
             f"{entries}\n}}; return t; }}\n}}\n")
    return EMU_HEADER + source + EMU_FOOTER + table


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _build(dtype) -> Path:
    """Compile the emulated kernels for one dtype (cached by source hash)."""
    source = emulator_source(dtype)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / f"llmtune-cuda-emu-{os.getuid()}"
    cache.mkdir(exist_ok=True)
    lib = cache / f"kernels-{np.dtype(dtype).name}-{digest}.so"
    if not lib.exists():
        src = cache / f"kernels-{np.dtype(dtype).name}-{digest}.cpp"
        src.write_text(source)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [compiler(), "-std=c++17", "-O1", "-U_FORTIFY_SOURCE", "-shared", "-fPIC", "-w", "-o", str(tmp), str(src)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(tmp, lib)
    return lib


class _Library:
    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.emu_launch.restype = ctypes.c_int
        self.lib.emu_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [ctypes.c_void_p]
        self.lib.emu_error.restype = ctypes.c_char_p
        self.lib.emu_signature.restype = ctypes.c_char_p
        self.lib.emu_signature.argtypes = [ctypes.c_char_p]
        self._sigs = {}

    def signature(self, name: str) -> list[str]:
        if name not in self._sigs:
            sig = self.lib.emu_signature(name.encode())
            if sig is None:
                raise KeyError(f"no kernel {name}")
            self._sigs[name] = sig.decode().split()
        return self._sigs[name]


def _describe_arg(arg) -> str:
    if isinstance(arg, np.ndarray):
        return "p" + ("f" if arg.dtype.kind == "f" else "i") + str(arg.dtype.itemsize)
    if isinstance(arg, (np.floating, np.integer)):
        return "s" + ("f" if isinstance(arg, np.floating) else "i") + str(arg.dtype.itemsize)
    raise TypeError(f"kernel argument of type {type(arg).__name__}: pass numpy scalars or arrays")


class EmuRuntime:
    """backends/cuda/runtime.py's device runtime on the CPU: numpy arrays, emulated kernels, literal cuBLAS."""

    xp = np
    device_name = "CPU emulator"

    def __init__(self):
        self._libs = {}
        self.launches = 0

    def prepare(self, dtype) -> None:
        self._lib(dtype)

    def _lib(self, dtype) -> _Library:
        dtype = np.dtype(dtype)
        if dtype not in self._libs:
            self._libs[dtype] = _Library(_build(dtype))
        return self._libs[dtype]

    def launch(self, name, dtype, grid, block, args) -> None:
        lib = self._lib(dtype)
        sig = lib.signature(name)
        got = [_describe_arg(a) for a in args]
        if got != sig:
            raise TypeError(f"kernel {name}: arguments {got} do not match parameters {sig}")
        holders = []
        ptrs = (ctypes.c_void_p * max(len(args), 1))()
        for i, (arg, kind) in enumerate(zip(args, sig)):
            if kind.startswith("p"):
                holder = ctypes.c_void_p(arg.ctypes.data)
            else:
                holder = _SCALAR_CTYPES[kind](arg.item())
            holders.append(holder)
            ptrs[i] = ctypes.addressof(holder)
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        self.launches += 1
        if lib.lib.emu_launch(name.encode(), *g, *b, ptrs) != 0:
            raise RuntimeError(f"kernel {name}: {lib.lib.emu_error().decode()}")

    def gemm(self, dtype, plan, x_ptr: int, y_ptr: int, c_ptr: int, precision: str = "f32") -> None:
        """cublas<t>gemmStridedBatched(alpha=1, beta=0) as cuBLAS defines it: column-major, raw pointers;
        precision tf32/bf16 rounds the inputs as the tensor-core compute types do."""
        dtype = np.dtype(dtype)
        size = dtype.itemsize
        m, n, k = plan.m_cm, plan.n_cm, plan.k
        x_rows, x_cols = (m, k) if plan.trans_x == 0 else (k, m)
        y_rows, y_cols = (k, n) if plan.trans_y == 0 else (n, k)
        for ld, rows in ((plan.ldx, x_rows), (plan.ldy, y_rows), (plan.ldc, m)):
            if ld < max(1, rows):
                raise ValueError(f"cuBLAS would reject ld {ld} < {rows} rows")
        for ox, oy, oc in plan.offsets:
            x = _colmajor(x_ptr + ox * size, dtype, x_rows, x_cols, plan.ldx, plan.stride_x, plan.batch)
            y = _colmajor(y_ptr + oy * size, dtype, y_rows, y_cols, plan.ldy, plan.stride_y, plan.batch)
            c = _colmajor(c_ptr + oc * size, dtype, m, n, plan.ldc, plan.stride_c, plan.batch)
            opx = _round_inputs(x if plan.trans_x == 0 else np.swapaxes(x, -1, -2), precision)
            opy = _round_inputs(y if plan.trans_y == 0 else np.swapaxes(y, -1, -2), precision)
            c[...] = np.matmul(opx, opy)

    @staticmethod
    def ptr(a) -> int:
        return a.ctypes.data

    @staticmethod
    def to_device(host, dtype):
        return np.array(host, dtype=dtype, order="C", copy=True)

    @staticmethod
    def to_host(a) -> np.ndarray:
        return np.array(a, copy=True)

    def synchronize(self) -> None:
        pass


def _round_inputs(a: np.ndarray, precision: str) -> np.ndarray:
    """float32 values rounded (to nearest even) to TF32's 10 or bf16's 7 mantissa bits."""
    if precision == "f32":
        return a
    drop = {"tf32": 13, "bf16": 16}[precision]
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + (1 << (drop - 1)) - 1 + ((bits >> drop) & 1)) >> drop << drop
    return bits.astype(np.uint32).view(np.float32)


def _colmajor(ptr: int, dtype, rows: int, cols: int, ld: int, stride: int, batch: int) -> np.ndarray:
    """The batch of column-major matrices cuBLAS would address at ptr, as a numpy view."""
    size = dtype.itemsize
    extent = (batch - 1) * stride + (rows - 1) + (cols - 1) * ld + 1
    buf = (ctypes.c_char * (extent * size)).from_address(ptr)
    base = np.frombuffer(buf, dtype=dtype)
    return np.lib.stride_tricks.as_strided(base, shape=(batch, rows, cols), strides=(stride * size, size, ld * size))


def available() -> bool:
    """g++ is there and the emulated kernels compile."""
    if compiler() is None:
        return False
    try:
        _build(np.float32)
        _build(np.float64)
    except (OSError, subprocess.CalledProcessError):
        return False
    return True
