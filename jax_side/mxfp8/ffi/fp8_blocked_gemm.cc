// XLA FFI handler: cuBLASLt's block-scaled FP8 GEMM on Hopper (CUDA >= 12.9), the `fp8_blocked`
// GEMM of jax_side.mxfp8 (DESIGN.md 11; Python side: jax_side/mxfp8/cublaslt.py, which builds
// this file on first use and registers the handler as "mxfp8_fp8_blocked_gemm").
//
//   out (M, N) = a (M, K) @ b (N, K)^T, row-major; a and b float8_e4m3fn;
//   a's fp32 scales: one per 1x128 block along K (cuBLASLt VEC128_32F);
//   b's fp32 scales: one per 128x128 tile (cuBLASLt BLK128x128_32F);
//   out bfloat16 or float32; fp32 accumulation, promoted every 128 of K by cuBLASLt;
//   a second result, a uint8 buffer, is cuBLASLt's workspace (XLA allocates it, JAX drops it).
// "mxfp8_fp8_blocked_gemm_into" (Mxfp8Fp8BlockedGemmInto): the same GEMM written into a flat
//   buffer at an element offset (a weight gradient straight into its grad bucket).
// "mxfp8_fp8_blocked_gemm_gelu_aux" (Mxfp8Fp8BlockedGemmGeluAux): the same GEMM with cuBLASLt's
//   GELU_AUX epilogue: out = GELU_tanh(acc) and aux = acc, both bfloat16 (M, N) (an MLP's first
//   linear: its GELU output and the pre-activation its backward needs).
// "mxfp8_zeroed_gaps" (Mxfp8ZeroedGaps): a flat buffer whose given byte ranges are zeroed and
//   whose other bytes are left as the allocator handed them over -- a grad bucket whose every
//   other byte is then written by the GEMMs and updates of the same program.
//
// cuBLASLt is column-major: it computes D (N x M, col-major == out row-major) = op(A) op(B) with
// A = b seen as a K x N col-major matrix, transposed (TN), and B = a seen as K x M col-major. The
// scale buffers are passed through in the layout the Python side arranged (cublaslt.py states
// it; tests/jax_side/mxfp8/test_fp8_blocked.py checks it on the GPU against the exact dot).

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::string LtError(const char* what, cublasStatus_t s) {
  return std::string("mxfp8_fp8_blocked_gemm: ") + what + " failed with cublasStatus " +
         std::to_string(static_cast<int>(s));
}

#define LT_TRY(call)                                                       \
  do {                                                                     \
    cublasStatus_t s_ = (call);                                            \
    if (s_ != CUBLAS_STATUS_SUCCESS) return ffi::Error::Internal(LtError(#call, s_)); \
  } while (0)

struct Handles {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> by_device;
  // (device, M, N, K, out dtype, epilogue) -> the heuristic's first algorithm (for the
  // workspace size jax_side/mxfp8/cublaslt.py passes, which is fixed, and 256-byte aligned
  // outputs)
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int, int>, cublasLtMatmulAlgo_t> algos;
};

Handles& handles() {
  static Handles* h = new Handles();  // never destroyed: handlers may run at exit
  return *h;
}

// RAII owners of the per-call descriptors (cheap host objects).
struct Desc {
  cublasLtMatmulDesc_t d = nullptr;
  ~Desc() { if (d) cublasLtMatmulDescDestroy(d); }
};
struct Layout {
  cublasLtMatrixLayout_t d = nullptr;
  ~Layout() { if (d) cublasLtMatrixLayoutDestroy(d); }
};
struct Pref {
  cublasLtMatmulPreference_t d = nullptr;
  ~Pref() { if (d) cublasLtMatmulPreferenceDestroy(d); }
};

// An epilogue and its bfloat16 (M x N row-major) auxiliary matrix (written by GELU_AUX; none
// for the plain GEMM).
struct Epilogue {
  cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
  void* aux = nullptr;
};

// The GEMM into `out_ptr` (M x N row-major of `out_elem`, leading dimension N): shared by every
// handler. `out_capacity`: elements available at out_ptr.
ffi::Error RunGemm(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                   ffi::Buffer<ffi::F32> a_scale, ffi::Buffer<ffi::F32> b_scale,
                   ffi::DataType out_elem, void* out_ptr, int64_t out_capacity,
                   ffi::Result<ffi::AnyBuffer>& workspace, Epilogue epi = Epilogue()) {
  if (a.element_type() != ffi::DataType::F8E4M3FN || b.element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("mxfp8_fp8_blocked_gemm: a and b must be float8_e4m3fn");
  auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2)
    return ffi::Error::InvalidArgument("mxfp8_fp8_blocked_gemm: a and b must be 2-D");
  const int64_t m = ad[0], k = ad[1], n = bd[0];
  if (bd[1] != k)
    return ffi::Error::InvalidArgument(
        "mxfp8_fp8_blocked_gemm: shapes do not chain: a (M, K), b (N, K)");
  if (m * n > out_capacity)
    return ffi::Error::InvalidArgument(
        "mxfp8_fp8_blocked_gemm: the output (M x N elements at its offset) overflows out");
  if (k % 128 || n % 128 || m % 16)
    return ffi::Error::InvalidArgument(
        "mxfp8_fp8_blocked_gemm: K and N must be multiples of 128 and M of 16 (pad first)");
  if (a_scale.element_count() < static_cast<size_t>(m * (k / 128)) ||
      b_scale.element_count() < static_cast<size_t>((n / 128) * (k / 128)))
    return ffi::Error::InvalidArgument(
        "mxfp8_fp8_blocked_gemm: a_scale needs M*K/128 and b_scale (N/128)*(K/128) values");
  cudaDataType_t out_type;
  if (out_elem == ffi::DataType::BF16) {
    out_type = CUDA_R_16BF;
  } else if (out_elem == ffi::DataType::F32) {
    out_type = CUDA_R_32F;
  } else {
    return ffi::Error::InvalidArgument("mxfp8_fp8_blocked_gemm: out must be bf16 or f32");
  }
  // cuBLASLt's kernels are picked for 256-byte aligned C and D (its default preference), one
  // algorithm per shape whatever the output's address, so a GEMM's bytes never depend on where
  // XLA placed its output. An output aligned less (XLA's own in-place dynamic-update-slice of
  // this call's result at an odd offset; the Python side asks the _into handler only for
  // 256-byte aligned offsets) is written to a 256-byte aligned stream-ordered scratch buffer and
  // copied into place.
  if (epi.kind != CUBLASLT_EPILOGUE_DEFAULT &&
      (out_elem != ffi::DataType::BF16 || reinterpret_cast<uintptr_t>(out_ptr) % 256 ||
       reinterpret_cast<uintptr_t>(epi.aux) % 256))
    return ffi::Error::InvalidArgument(
        "mxfp8_fp8_blocked_gemm: a GELU epilogue needs a bfloat16 output and 256-byte aligned "
        "output and auxiliary buffers (XLA's own buffers are)");
  if (reinterpret_cast<uintptr_t>(out_ptr) % 256) {
    // Inside a CUDA graph (the *Graph handlers, captured into XLA's command buffers) the
    // scratch buffer cannot be allocated: stream-ordered allocations cannot live in the child
    // graph XLA records a custom call into. Refused, never run with another algorithm.
    // (A failed query falls through: under capture the allocation below then fails, and says so.)
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
        capture != cudaStreamCaptureStatusNone)
      return ffi::Error::InvalidArgument(
          "mxfp8_fp8_blocked_gemm: an output that is not 256-byte aligned inside an XLA command "
          "buffer (CUDA graph): its aligned scratch copy cannot be captured; set "
          "jax_side.mxfp8.cublaslt.COMMAND_BUFFERS = False (the handlers outside graphs)");
    const size_t bytes = static_cast<size_t>(m * n) * (out_elem == ffi::DataType::F32 ? 4 : 2);
    void* tmp = nullptr;
    if (cudaMallocAsync(&tmp, bytes, stream) != cudaSuccess)
      return ffi::Error::Internal(
          "mxfp8_fp8_blocked_gemm: cudaMallocAsync of a scratch output failed (the output is "
          "not 256-byte aligned)");
    ffi::Error err = reinterpret_cast<uintptr_t>(tmp) % 256
        ? ffi::Error::Internal("mxfp8_fp8_blocked_gemm: a scratch output not 256-byte aligned")
        : RunGemm(stream, a, b, a_scale, b_scale, out_elem, tmp, m * n, workspace);
    const bool copied = err.success() && cudaMemcpyAsync(out_ptr, tmp, bytes,
                                                         cudaMemcpyDeviceToDevice,
                                                         stream) == cudaSuccess;
    cudaFreeAsync(tmp, stream);
    if (err.failure()) return err;
    if (!copied)
      return ffi::Error::Internal("mxfp8_fp8_blocked_gemm: cudaMemcpyAsync into place failed");
    return ffi::Error::Success();
  }

  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess)
    return ffi::Error::Internal("mxfp8_fp8_blocked_gemm: cudaGetDevice failed");
  Handles& h = handles();
  std::lock_guard<std::mutex> lock(h.mu);
  cublasLtHandle_t& lt = h.by_device[device];
  if (lt == nullptr) LT_TRY(cublasLtCreate(&lt));

  Desc desc;
  LT_TRY(cublasLtMatmulDescCreate(&desc.d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;  // cuBLASLt's A = our b
  const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;      // cuBLASLt's B = our a
  LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode,
                                        sizeof(a_mode)));
  LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode,
                                        sizeof(b_mode)));
  if (epi.kind != CUBLASLT_EPILOGUE_DEFAULT) {
    const int64_t aux_ld = n;  // aux is (M, N) row-major, as D
    const int32_t aux_type = CUDA_R_16BF;
    LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi.kind,
                                          sizeof(epi.kind)));
    LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                          &epi.aux, sizeof(epi.aux)));
    LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                          sizeof(aux_ld)));
    LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                                          &aux_type, sizeof(aux_type)));
  }
  const void* a_scale_ptr = b_scale.typed_data();
  const void* b_scale_ptr = a_scale.typed_data();
  LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                        &a_scale_ptr, sizeof(a_scale_ptr)));
  LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                        &b_scale_ptr, sizeof(b_scale_ptr)));

  Layout la, lb, ld;
  LT_TRY(cublasLtMatrixLayoutCreate(&la.d, CUDA_R_8F_E4M3, k, n, k));
  LT_TRY(cublasLtMatrixLayoutCreate(&lb.d, CUDA_R_8F_E4M3, k, m, k));
  LT_TRY(cublasLtMatrixLayoutCreate(&ld.d, out_type, n, m, n));

  auto key = std::make_tuple(device, m, n, k, static_cast<int>(out_type),
                             static_cast<int>(epi.kind));
  auto found = h.algos.find(key);
  if (found == h.algos.end()) {
    Pref pref;
    LT_TRY(cublasLtMatmulPreferenceCreate(&pref.d));
    const uint64_t ws = workspace->size_bytes();
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(
        pref.d, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    cublasLtMatmulHeuristicResult_t result = {};
    int returned = 0;
    LT_TRY(cublasLtMatmulAlgoGetHeuristic(lt, desc.d, la.d, lb.d, ld.d, ld.d, pref.d, 1, &result,
                                          &returned));
    if (returned == 0)
      return ffi::Error::Internal(
          epi.kind == CUBLASLT_EPILOGUE_DEFAULT
              ? "mxfp8_fp8_blocked_gemm: cuBLASLt has no block-scaled FP8 algorithm for this "
                "GEMM on this GPU (it needs compute capability 9.x and CUDA >= 12.9)"
              : "mxfp8_fp8_blocked_gemm: cuBLASLt has no block-scaled FP8 algorithm with this "
                "GELU epilogue for this GEMM on this GPU");
    found = h.algos.emplace(key, result.algo).first;
  }

  const size_t workspace_bytes = workspace->size_bytes();
  const float alpha = 1.0f, beta = 0.0f;
  LT_TRY(cublasLtMatmul(lt, desc.d, &alpha, b.untyped_data(), la.d, a.untyped_data(), lb.d, &beta,
                        out_ptr, ld.d, out_ptr, ld.d, &found->second,
                        workspace->untyped_data(), workspace_bytes, stream));
  return ffi::Error::Success();
}

ffi::Error Fp8BlockedGemm(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                          ffi::Buffer<ffi::F32> a_scale,
                          ffi::Buffer<ffi::F32> b_scale, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  auto od = out->dimensions();
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("mxfp8_fp8_blocked_gemm: a and b must be 2-D");
  if (od.size() != 2 || od[0] != a.dimensions()[0] || od[1] != b.dimensions()[0])
    return ffi::Error::InvalidArgument("mxfp8_fp8_blocked_gemm: out must be (M, N)");
  return RunGemm(stream, a, b, a_scale, b_scale, out->element_type(), out->untyped_data(),
                 static_cast<int64_t>(out->element_count()), workspace);
}

// The same GEMM written into a flat buffer at element `offset` (row-major M x N there; the rest
// of the buffer untouched): `buf` is aliased to `out` (the Python side's input_output_aliases),
// so a gradient lands in its grad bucket without a copy.
ffi::Error Fp8BlockedGemmInto(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                              ffi::Buffer<ffi::F32> a_scale, ffi::Buffer<ffi::F32> b_scale,
                              ffi::AnyBuffer buf, int64_t offset,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> workspace) {
  if (out->untyped_data() != buf.untyped_data())
    return ffi::Error::InvalidArgument(
        "mxfp8_fp8_blocked_gemm_into: out must alias buf (input_output_aliases)");
  const int64_t total = static_cast<int64_t>(out->element_count());
  if (out->dimensions().size() != 1 || offset < 0 || offset > total)
    return ffi::Error::InvalidArgument(
        "mxfp8_fp8_blocked_gemm_into: buf must be 1-D and offset inside it");
  const size_t elem = out->element_type() == ffi::DataType::F32 ? 4 : 2;
  char* base = static_cast<char*>(out->untyped_data()) + offset * elem;
  return RunGemm(stream, a, b, a_scale, b_scale, out->element_type(), base, total - offset,
                 workspace);
}

// The GEMM with the GELU_AUX epilogue: out = GELU(acc), aux = acc (both bf16, M x N).
ffi::Error Fp8BlockedGemmGeluAux(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                                 ffi::Buffer<ffi::F32> a_scale, ffi::Buffer<ffi::F32> b_scale,
                                 ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> aux,
                                 ffi::Result<ffi::AnyBuffer> workspace) {
  auto od = out->dimensions(), xd = aux->dimensions();
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2 || od.size() != 2 ||
      od[0] != a.dimensions()[0] || od[1] != b.dimensions()[0] || xd.size() != 2 ||
      xd[0] != od[0] || xd[1] != od[1] || aux->element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(
        "mxfp8_fp8_blocked_gemm_gelu_aux: a, b 2-D; out and aux bf16 (M, N)");
  Epilogue epi;
  epi.kind = CUBLASLT_EPILOGUE_GELU_AUX;
  epi.aux = aux->untyped_data();
  return RunGemm(stream, a, b, a_scale, b_scale, out->element_type(), out->untyped_data(),
                 static_cast<int64_t>(out->element_count()), workspace, epi);
}

// A buffer of which only the byte ranges (gaps[2i], gaps[2i + 1]) -- start, length -- are
// zeroed (cudaMemsetAsync on the program's stream); every other byte is left unwritten for the
// program to fill (unit_grads.flat_group: the ranges are the complement of the gradients' slots).
ffi::Error ZeroedGaps(cudaStream_t stream, ffi::Span<const int64_t> gaps,
                      ffi::Result<ffi::AnyBuffer> out) {
  const int64_t total = static_cast<int64_t>(out->size_bytes());
  if (gaps.size() % 2)
    return ffi::Error::InvalidArgument("mxfp8_zeroed_gaps: gaps must be (start, length) pairs");
  char* base = static_cast<char*>(out->untyped_data());
  for (size_t i = 0; i < gaps.size(); i += 2) {
    const int64_t start = gaps[i], length = gaps[i + 1];
    if (start < 0 || length < 0 || start + length > total)
      return ffi::Error::InvalidArgument("mxfp8_zeroed_gaps: a gap lies outside the buffer");
    if (length && cudaMemsetAsync(base + start, 0, static_cast<size_t>(length), stream) !=
                      cudaSuccess)
      return ffi::Error::Internal("mxfp8_zeroed_gaps: cudaMemsetAsync failed");
  }
  return ffi::Error::Success();
}

}  // namespace

// The GEMM handlers' common binding: the stream, then a's and b's e4m3 data and fp32 scales.
static auto GemmOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

// Each handler twice: as is, and as *Graph with the command-buffer trait, so XLA records it
// into its CUDA graphs with the kernels around it (one graph launch instead of a launch per
// thunk; jax_side.mxfp8.cublaslt.COMMAND_BUFFERS picks the targets). Both run the same code:
// under capture the host-side work (descriptors, the algorithm cache) runs once per recording,
// and every device allocation is one XLA passed in (the workspace), as the trait requires.
#define MXFP8_HANDLERS(name, impl, binding)              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, binding);    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Graph, impl, binding, \
                                {ffi::Traits::kCmdBufferCompatible})

MXFP8_HANDLERS(Mxfp8Fp8BlockedGemm, Fp8BlockedGemm,
               GemmOperands()
                   .Ret<ffi::AnyBuffer>()    // out
                   .Ret<ffi::AnyBuffer>());  // workspace (uint8, discarded)

MXFP8_HANDLERS(Mxfp8Fp8BlockedGemmInto, Fp8BlockedGemmInto,
               GemmOperands()
                   .Arg<ffi::AnyBuffer>()    // buf (aliased to out)
                   .Attr<int64_t>("offset")
                   .Ret<ffi::AnyBuffer>()    // out: buf with the GEMM written
                   .Ret<ffi::AnyBuffer>());  // workspace (uint8, discarded)

MXFP8_HANDLERS(Mxfp8Fp8BlockedGemmGeluAux, Fp8BlockedGemmGeluAux,
               GemmOperands()
                   .Ret<ffi::AnyBuffer>()    // out: GELU(acc)
                   .Ret<ffi::AnyBuffer>()    // aux: acc
                   .Ret<ffi::AnyBuffer>());  // workspace (uint8, discarded)

MXFP8_HANDLERS(Mxfp8ZeroedGaps, ZeroedGaps,
               ffi::Ffi::Bind()
                   .Ctx<ffi::PlatformStream<cudaStream_t>>()
                   .Attr<ffi::Span<const int64_t>>("gaps")
                   .Ret<ffi::AnyBuffer>());  // the buffer
