"""cuBLASLt's block-scaled FP8 GEMM as an XLA FFI custom call: the ``fp8_blocked`` GEMM's kernel on
Hopper (DESIGN.md 11; the C++ handler is ``ffi/fp8_blocked_gemm.cc``).

``blocked_gemm(a, b)`` computes (M, N) = a (M, K) @ b (N, K)^T on re-blocked operands
(``reblock``: a in 1x128 blocks, b in 128x128 tiles) with cuBLASLt's
``CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F`` x ``BLK128x128_32F`` FP8 GEMM (CUDA >= 12.9, compute
capability 9.x): FP8 tensor cores, fp32 accumulation promoted every 128 of K, each block's scale
applied exactly (powers of two).

``blocked_gemm_into(buf, start, a, b)`` is the same GEMM written straight into a flat float32 or
bfloat16 buffer at element ``start`` (a second handler, ``Mxfp8Fp8BlockedGemmInto``, whose output
is aliased to ``buf``): the unit programs use it to put each weight gradient where the gradient
bucket holds it (``unit_grads.pack_grads``), with no (M, N) temporary and no copy. Its bytes
equal ``lax.dynamic_update_slice`` of ``blocked_gemm``'s result; ``start`` must be
``INTO_ALIGN_BYTES``-aligned. Both handlers take an output at any address and run one cuBLASLt
algorithm per shape, picked for 256-byte aligned outputs, so the bytes never depend on where the
output lies: an output XLA places less aligned (its in-place dynamic-update-slice of a GEMM's
result at an odd offset) is written to an aligned stream-ordered scratch buffer and copied into
place.

``blocked_gemm_gelu(a, b)`` runs the same GEMM with cuBLASLt's ``GELU_AUX`` epilogue (a fourth
handler): the tanh GELU of the fp32 accumulator and the accumulator itself, both bfloat16, so an
MLP's first linear writes its GELU's output and input in one pass (``jax_side.mxfp8.epilogue``
states the numbers).

``zeroed_gaps(numel, dtype, gaps)`` (another handler, ``Mxfp8ZeroedGaps``) makes a flat buffer
whose given element ranges are zeroed (``cudaMemsetAsync``) and whose other elements are left as
the allocator handed them over, for a program that writes every one of them itself: a gradient
group whose weight gradients cuBLASLt writes in place (``unit_grads.flat_group``) needs zeros
only in the padding between its slots, not a fill of the whole bucket first (a 805 MB fp32
bucket of a 4-block 1.3B unit: an XLA fill kernel of about 0.14 ms per step and unit on the
H200, BENCHMARKS.md, sessions 7 and 8).

**Command buffers.** XLA records runs of its kernels into CUDA graphs (command buffers) and
launches each graph at once; a custom call joins a graph only if its handler declares itself
compatible, otherwise it splits the graph and is launched on its own, with XLA's host work and
a launch gap around it. Each handler is built twice: as is, and as a twin (target name +
``GRAPH_SUFFIX``, symbol + ``Graph``) that declares the trait, with the same code: under capture
its host work (descriptors, the cached algorithm) runs once per recording and the kernel it
enqueues is replayed; its only device memory is what XLA passes (the workspace). Programs
traced while ``COMMAND_BUFFERS`` is on call the twins. The one thing the twins refuse is an
output that is not 256-byte aligned (its scratch copy would be a stream-ordered allocation,
which a recorded graph cannot hold): a clear error, never another algorithm. The bytes are the
same either way (tested on the GPU, ``tests/jax_side/mxfp8/test_fp8_blocked.py``).

**Building.** Nothing is compiled at install time. The first call in a process builds the handler
(one ``g++`` run, about 5 s) against the installed jaxlib's FFI headers and the CUDA toolkit's
(or the ``nvidia-*`` wheels') cuBLASLt and runtime headers, into a private cache directory
(default ``~/.cache/mxfp8-fsdp/ffi``, created ``0700``; another user's or a group-writable
directory is refused, as for the JAX compilation cache: a process loads what is there), named by
the hash of the source, jaxlib's version and the headers, so a changed source or jaxlib builds
anew. ``status()`` says whether the kernel can run here and, if not, why (no GPU, a GPU other
than compute capability 9.x, no compiler, no cuBLASLt headers): ``kernel_report`` shows it, and
the ``fp8_blocked`` GEMM then refuses with that reason instead of running something else.
On a CPU the module is imported but never builds anything.

**Self-check.** Before first use, ``status()`` runs one GEMM with random power-of-two scales and
compares it with the exact dot of the same re-blocked values (``reblock.blocked_dot_reference``),
in each arrangement of the scales in ``LAYOUTS`` (which axis is contiguous, padded leading
dimension or not); the first within ``SELF_CHECK_BOUND`` is used, and none agreeing makes the
kernel unavailable with that reason (each layout's error in it): a kernel that returns wrong
numbers is never used silently.
``tests/jax_side/mxfp8/test_fp8_blocked.py`` checks it again on the GPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_side.compile_cache import check_private
from jax_side.mxfp8.reblock import GROUP, Reblocked, scale_fp32

__all__ = [
    "COMMAND_BUFFERS", "GRAPH_SUFFIX", "INTO_ALIGN_BYTES", "LAYOUTS", "SELF_CHECK_BOUND",
    "SOURCE", "TARGET", "TARGET_GAPS", "TARGET_GELU_AUX", "TARGET_INTO", "WORKSPACE_BYTES",
    "Status", "blocked_gemm", "blocked_gemm_gelu", "blocked_gemm_into",
    "default_cache_dir", "raw_call", "raw_call_into", "status", "zeroed_gaps",
]

SOURCE = Path(__file__).with_name("ffi") / "fp8_blocked_gemm.cc"
TARGET = "mxfp8_fp8_blocked_gemm"
TARGET_INTO = "mxfp8_fp8_blocked_gemm_into"  # the same GEMM written into a flat buffer
TARGET_GAPS = "mxfp8_zeroed_gaps"  # a flat buffer with only its gaps zeroed (zeroed_gaps)
TARGET_GELU_AUX = "mxfp8_fp8_blocked_gemm_gelu_aux"  # the GEMM, its GELU and its input
_SYMBOLS = {TARGET: "Mxfp8Fp8BlockedGemm", TARGET_INTO: "Mxfp8Fp8BlockedGemmInto",
            TARGET_GAPS: "Mxfp8ZeroedGaps", TARGET_GELU_AUX: "Mxfp8Fp8BlockedGemmGeluAux"}
GRAPH_SUFFIX = "_graph"  # each target's twin declared command-buffer compatible (``_target``)
# Whether programs traced from now on call the handlers' command-buffer twins (module note,
# "Command buffers"). Read when a program is traced: set it before the first trace, or call
# ``jax.clear_caches()`` after changing it.
COMMAND_BUFFERS = False
_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-w")


class Status(NamedTuple):
    """Whether the cuBLASLt kernel runs in this process, and why (not); ``layout``: the scale
    layouts (``LAYOUTS``) its self-check found cuBLASLt to read."""

    ok: bool
    reason: str
    library: Path | None = None
    layout: tuple[str, str] | None = None


# Arrangements of a's (M, K/128) and b's (N/128, K/128) fp32 scales: which axis is contiguous,
# b's with its leading dimension padded to a multiple of 4 or not. The self-check tries them in
# this order: first the one cuBLASLt 13.0 read on an H200 (2026-12-03: a's scales M-contiguous,
# b's K/128-contiguous with rows padded to a multiple of 4; every other arrangement gave
# relative errors of 1.0-1.3 there), then the others.
LAYOUTS: tuple[tuple[str, str], ...] = (("m_fastest", "k_fastest_ld4"), *(
    (a, b) for a in ("k_fastest", "m_fastest")
    for b in ("n_fastest_ld4", "n_fastest", "k_fastest_ld4", "k_fastest")
    if (a, b) != ("m_fastest", "k_fastest_ld4")))
# A layout is accepted when its relative (Frobenius) distance from the exact dot of the same
# values is below this: a wrong layout scales blocks by wrong powers of two (distance of order
# 1); the FP8 tensor cores' own accumulation inside each 128-wide block is far below it.
SELF_CHECK_BOUND = 1e-3


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "mxfp8-fsdp" / "ffi"


def _cuda_dirs() -> tuple[list[Path], list[Path]]:
    """(include dirs, library dirs) that hold cuBLASLt's and the CUDA runtime's headers and
    libraries: the CUDA toolkit at /usr/local/cuda, then the nvidia-* wheels beside JAX."""
    roots = [Path("/usr/local/cuda")]
    for entry in sys.path:
        nv = Path(entry) / "nvidia"
        if nv.is_dir():
            roots += sorted(p for p in nv.iterdir() if p.is_dir())
            roots += sorted(p for p in nv.glob("*/*") if p.is_dir())
    incs, libs = [], []
    for root in roots:
        for inc in (root / "include", root / "targets" / "x86_64-linux" / "include"):
            if (inc / "cublasLt.h").is_file() or (inc / "cuda_runtime_api.h").is_file():
                incs.append(inc)
        for lib in (root / "lib64", root / "lib"):
            if any(lib.glob("libcublasLt.so*")) or any(lib.glob("libcudart.so*")):
                libs.append(lib)
    return list(dict.fromkeys(incs)), list(dict.fromkeys(libs))


def _find(dirs: list[Path], pattern: str) -> Path | None:
    for d in dirs:
        hits = sorted(d.glob(pattern))
        if hits:
            return hits[0]
    return None


def _link_flags(libs: list[Path]) -> list[str] | str:
    """-l flags for cuBLASLt and the CUDA runtime (by file when only a versioned .so exists), or
    what is missing."""
    flags: list[str] = []
    for name in ("cublasLt", "cudart"):
        found = _find(libs, f"lib{name}.so*")
        if found is None:
            return f"no lib{name}.so in {[str(d) for d in libs] or 'any CUDA library folder'}"
        flags += [f"-L{found.parent}", f"-Wl,-rpath,{found.parent}",
                  f"-l{name}" if (found.parent / f"lib{name}.so").exists() else f"-l:{found.name}"]
    return flags


def _build(cache_dir: Path) -> Path:
    """The handler's shared library, built into ``cache_dir`` unless already there."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH to build the cuBLASLt FFI handler")
    incs, libs = _cuda_dirs()
    header = _find(incs, "cublasLt.h")
    if header is None or _find(incs, "cuda_runtime_api.h") is None:
        raise RuntimeError(
            "cuBLASLt / CUDA runtime headers not found (looked in /usr/local/cuda and the "
            "nvidia-* wheels); install the CUDA toolkit or the nvidia-cublas and "
            "nvidia-cuda-runtime wheels")
    link = _link_flags(libs)
    if isinstance(link, str):
        raise RuntimeError(link)
    import jaxlib

    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jaxlib.__version__.encode(), header.read_bytes(),
                 " ".join([*_FLAGS, *link]).encode()):
        digest.update(part)
    out = cache_dir / f"fp8_blocked_gemm-{digest.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(cache_dir)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", *(f"-I{d}" for d in incs),
           str(SOURCE), "-o", tmp, *link]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(
            f"building {SOURCE.name} failed:\n{' '.join(cmd)}\n{done.stderr[-3000:]}")
    os.replace(tmp, out)  # atomic: a concurrent builder sees the old file or the whole new one
    return out


_lock = threading.Lock()
_status: dict[Path, Status] = {}


def _gpu_reason() -> str | None:
    device = jax.devices()[0]
    if device.platform != "gpu":
        return f"JAX's default device is {device.platform}, not a CUDA GPU"
    cc = getattr(device, "compute_capability", "")
    if not str(cc).startswith("9."):
        return (f"{device.device_kind} has compute capability {cc}; cuBLASLt's 1x128 x 128x128 "
                "block-scaled FP8 GEMM is the Hopper (9.x) path (10.x runs MXFP8 natively)")
    return None


def status(cache_dir: Path | None = None) -> Status:
    """Whether the kernel runs here (building, registering and self-checking it on the first
    call), and why not. Never raises: a failure is the reason."""
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    with _lock:
        if cache_dir in _status:
            return _status[cache_dir]
        reason = _gpu_reason()
        if reason is not None:
            result = Status(False, reason)
        else:
            try:
                lib = _build(cache_dir)
                loaded = ctypes.cdll.LoadLibrary(str(lib))
                for target, symbol in _SYMBOLS.items():
                    for suffix, twin in (("", ""), (GRAPH_SUFFIX, "Graph")):
                        jax.ffi.register_ffi_target(
                            target + suffix, jax.ffi.pycapsule(getattr(loaded, symbol + twin)),
                            platform="CUDA")
                # eagerly, also when the first use is inside a traced program (a jit's trace
                # stages every jnp op; the check needs concrete numbers)
                with jax.ensure_compile_time_eval():
                    layout, errors = _self_check()
                result = (Status(True, f"cuBLASLt block-scaled FP8 GEMM ({lib.name}, scale "
                                 f"layouts {layout[0]}/{layout[1]}, self-check {errors})", lib,
                                 layout)
                          if layout is not None else
                          Status(False, "cuBLASLt's block-scaled FP8 GEMM disagreed with the "
                                 "exact dot of the same values in every known scale layout "
                                 f"(relative errors {errors}): it is not used", lib))
            except Exception as e:  # noqa: BLE001 -- the reason is the answer
                result = Status(False, f"{type(e).__name__}: {e}")
        _status[cache_dir] = result
        return result


def _self_check() -> tuple[tuple[str, str] | None, str]:
    """The first of ``LAYOUTS`` in which one GEMM with random power-of-two scales (N/128 = 6,
    not a multiple of 4) is within ``SELF_CHECK_BOUND`` of the exact dot of the same re-blocked
    values (None if none is), and each tried layout's relative error. Guards against a cuBLASLt
    that reads its scales in another layout than the one assumed."""
    import numpy as np

    from jax_side.mxfp8.reblock import blocked_dot_reference

    m, k, n = 256, 512, 768
    rng = np.random.default_rng(0)
    codes = rng.standard_normal((m + n, k)) * 64
    data = jnp.asarray(codes, jnp.float32).astype(jnp.float8_e4m3fn)
    a = Reblocked(data[:m], jnp.asarray(rng.integers(118, 136, (m, k // GROUP)), jnp.uint8))
    b = Reblocked(data[m:], jnp.asarray(rng.integers(118, 136, (n // GROUP, k // GROUP)),
                                        jnp.uint8))
    ref = np.asarray(blocked_dot_reference(a, b), np.float64)
    errors = []
    for layout in LAYOUTS:
        got = np.asarray(_call(a.data, a.scale, b.data, b.scale, out_dtype=jnp.dtype(jnp.float32),
                               layout=layout, graphs=False), np.float64)
        rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        errors.append(f"{layout[0]}/{layout[1]} {rel:.1e}")
        if rel <= SELF_CHECK_BOUND:
            return layout, "; ".join(errors)
    return None, "; ".join(errors)


def _scales(a: Reblocked, b: Reblocked, layout: tuple[str, str]) -> tuple[jax.Array, jax.Array]:
    """fp32 scales of a and b, flat, in ``layout`` (``LAYOUTS``)."""
    sa, sb = scale_fp32(a.scale), scale_fp32(b.scale)
    sa = sa.T if layout[0] == "m_fastest" else sa
    sb = sb.T if layout[1].startswith("n_fastest") else sb
    if layout[1].endswith("ld4"):
        sb = jnp.pad(sb, ((0, 0), (0, -sb.shape[1] % 4)))
    return sa.reshape(-1), sb.reshape(-1)


WORKSPACE_BYTES = 32 << 20  # cuBLASLt's workspace, cuBLAS's advice for Hopper


def _target(base: str, graphs: bool | None = None) -> str:
    """The FFI target a program traced now calls for ``base``: its command-buffer twin where
    ``graphs`` (default: ``COMMAND_BUFFERS``) is on."""
    return base + GRAPH_SUFFIX if (COMMAND_BUFFERS if graphs is None else graphs) else base


def raw_call(a_data: jax.Array, b_data: jax.Array, a_scale: jax.Array, b_scale: jax.Array,
             out_dtype: Any, graphs: bool | None = None) -> jax.Array:
    """The FFI call itself: e4m3 data and fp32 scales already in cuBLASLt's layouts (flat)."""
    m, n = a_data.shape[0], b_data.shape[0]
    call = jax.ffi.ffi_call(_target(TARGET, graphs), (jax.ShapeDtypeStruct((m, n), out_dtype),
                                     jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)))
    return call(a_data, b_data, a_scale, b_scale)[0]


def raw_call_into(buf: jax.Array, start: int, a_data: jax.Array, b_data: jax.Array,
                  a_scale: jax.Array, b_scale: jax.Array) -> jax.Array:
    """``buf`` (1-D, float32 or bfloat16) with a_data @ b_data^T written row-major at element
    ``start`` and nothing else changed; ``buf`` is aliased to the result (XLA writes in place
    where ``buf`` is not needed afterwards, else it copies it first)."""
    call = jax.ffi.ffi_call(_target(TARGET_INTO), (
        jax.ShapeDtypeStruct(buf.shape, buf.dtype),
        jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)), input_output_aliases={4: 0})
    return call(a_data, b_data, a_scale, b_scale, buf, offset=np.int64(start))[0]


@functools.partial(jax.jit, static_argnames=("out_dtype", "layout", "graphs"))
def _call(a_data: jax.Array, a_scale: jax.Array, b_data: jax.Array, b_scale: jax.Array, *,
          out_dtype: Any, layout: tuple[str, str], graphs: bool) -> jax.Array:
    sa, sb = _scales(Reblocked(a_data, a_scale), Reblocked(b_data, b_scale), layout)
    return raw_call(a_data, b_data, sa, sb, out_dtype, graphs)


def blocked_gemm(a: Reblocked, b: Reblocked, *, out_dtype: Any = jnp.float32) -> jax.Array:
    """(M, N) = a (M, K; 1x128 blocks) @ b (N, K; 128x128 tiles)^T through cuBLASLt. K and N must
    be multiples of 128 and M of 16 (the fp8_blocked GEMM pads). Raises with ``status()``'s
    reason where the kernel cannot run."""
    layout = _checked_layout("blocked_gemm", a, b)
    return _call(a.data, a.scale, b.data, b.scale, out_dtype=jnp.dtype(out_dtype), layout=layout,
                 graphs=COMMAND_BUFFERS)


def _checked_layout(name: str, a: Reblocked, b: Reblocked) -> tuple[str, str]:
    """The scale layout this GPU's cuBLASLt reads, after checking that the kernel runs here and
    that a and b have shapes it takes; raises naming ``name`` otherwise."""
    st = status()
    if not st.ok or st.layout is None:
        raise RuntimeError(f"the cuBLASLt fp8_blocked kernel cannot run here: {st.reason}")
    (m, k), (n, kb) = a.data.shape, b.data.shape
    if k != kb or k % GROUP or n % GROUP or m % 16:
        raise ValueError(f"{name}: a is {(m, k)}, b is {(n, kb)}; K must agree, K and N be "
                         f"multiples of {GROUP} and M of 16")
    return st.layout


@functools.partial(jax.jit, static_argnames=("layout", "graphs"))
def _call_gelu(a_data: jax.Array, a_scale: jax.Array, b_data: jax.Array, b_scale: jax.Array, *,
               layout: tuple[str, str], graphs: bool) -> tuple[jax.Array, jax.Array]:
    sa, sb = _scales(Reblocked(a_data, a_scale), Reblocked(b_data, b_scale), layout)
    shape = jax.ShapeDtypeStruct((a_data.shape[0], b_data.shape[0]), jnp.bfloat16)
    call = jax.ffi.ffi_call(_target(TARGET_GELU_AUX, graphs), (
        shape, shape, jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)))
    out, aux, _ = call(a_data, b_data, sa, sb)
    return out, aux


def blocked_gemm_gelu(a: Reblocked, b: Reblocked) -> tuple[jax.Array, jax.Array]:
    """(GELU_tanh(acc), acc), both bfloat16 (M, N), acc = ``blocked_gemm``'s fp32 accumulator:
    cuBLASLt's ``GELU_AUX`` epilogue, one pass over the output. Shapes as ``blocked_gemm``."""
    layout = _checked_layout("blocked_gemm_gelu", a, b)
    return _call_gelu(a.data, a.scale, b.data, b.scale, layout=layout, graphs=COMMAND_BUFFERS)


INTO_ALIGN_BYTES = 256  # where blocked_gemm_into may start writing (cuBLASLt's default for D)


def blocked_gemm_into(buf: jax.Array, start: int, a: Reblocked, b: Reblocked) -> jax.Array:
    """``buf`` with ``blocked_gemm(a, b, out_dtype=buf.dtype)`` written (row-major, M*N
    elements) at element ``start``: the same bytes as ``lax.dynamic_update_slice`` of that
    result (``tests/jax_side/mxfp8/test_wgrad_into.py``), with no (M, N) temporary and no copy.
    ``start`` must be a static int whose byte offset is a multiple of ``INTO_ALIGN_BYTES``."""
    layout = _checked_layout("blocked_gemm_into", a, b)
    m, n = a.data.shape[0], b.data.shape[0]
    if buf.ndim != 1 or buf.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"blocked_gemm_into: buf must be a 1-D float32 or bfloat16 array, got "
                         f"{buf.dtype}{list(buf.shape)}")
    if (start < 0 or start + m * n > buf.shape[0]
            or start * buf.dtype.itemsize % INTO_ALIGN_BYTES):
        raise ValueError(f"blocked_gemm_into: {m} x {n} elements at {start} do not fit in "
                         f"{buf.shape[0]}, or start is not {INTO_ALIGN_BYTES}-byte aligned")
    sa, sb = _scales(a, b, layout)
    return raw_call_into(buf, start, a.data, b.data, sa, sb)


def zeroed_gaps(numel: int, dtype: Any, gaps: tuple[tuple[int, int], ...]) -> jax.Array:
    """A 1-D ``numel``-element ``dtype`` buffer whose (start, length) element ranges ``gaps``
    are zero; **every other element is undefined** (what the allocator's memory held) until the
    caller writes it -- ``unit_grads.flat_group`` writes each gradient's slot and passes the rest
    as gaps. Raises with ``status()``'s reason where the handler cannot run."""
    st = status()
    if not st.ok:
        raise RuntimeError(f"the cuBLASLt FFI handlers cannot run here: {st.reason}")
    size = jnp.dtype(dtype).itemsize
    spans = []
    for start, length in gaps:
        if start < 0 or length < 0 or start + length > numel:
            raise ValueError(f"zeroed_gaps: the gap ({start}, {length}) lies outside the "
                             f"{numel}-element buffer")
        spans += [start * size, length * size]
    call = jax.ffi.ffi_call(_target(TARGET_GAPS), jax.ShapeDtypeStruct((numel,), jnp.dtype(dtype)))
    return call(gaps=np.asarray(spans or [0, 0], np.int64))  # (0, 0): no gap, no empty array
