// XLA FFI handler: cuBLASLt's block-scaled FP8 GEMM on Hopper (CUDA >= 12.9), the `fp8_blocked`
// GEMM of jax_side.mxfp8 (DESIGN.md 11; Python side: jax_side/mxfp8/cublaslt.py, which builds
// this file on first use and registers the handler as "mxfp8_fp8_blocked_gemm").
//
//   out (M, N) = a (M, K) @ b (N, K)^T, row-major; a and b float8_e4m3fn;
//   a's fp32 scales: one per 1x128 block along K (cuBLASLt VEC128_32F);
//   b's fp32 scales: one per 128x128 tile (cuBLASLt BLK128x128_32F);
//   out bfloat16 or float32; fp32 accumulation, promoted every 128 of K by cuBLASLt;
//   a second result, a uint8 buffer, is cuBLASLt's workspace (XLA allocates it, JAX drops it).
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
  // (device, M, N, K, out dtype) -> the heuristic's first algorithm (for the workspace size
  // jax_side/mxfp8/cublaslt.py passes, which is fixed)
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int>, cublasLtMatmulAlgo_t> algos;
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

ffi::Error Fp8BlockedGemm(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                          ffi::Buffer<ffi::F32> a_scale,
                          ffi::Buffer<ffi::F32> b_scale, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  if (a.element_type() != ffi::DataType::F8E4M3FN || b.element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("mxfp8_fp8_blocked_gemm: a and b must be float8_e4m3fn");
  auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || od.size() != 2)
    return ffi::Error::InvalidArgument("mxfp8_fp8_blocked_gemm: a, b and out must be 2-D");
  const int64_t m = ad[0], k = ad[1], n = bd[0];
  if (bd[1] != k || od[0] != m || od[1] != n)
    return ffi::Error::InvalidArgument(
        "mxfp8_fp8_blocked_gemm: shapes do not chain: a (M, K), b (N, K), out (M, N)");
  if (k % 128 || n % 128 || m % 16)
    return ffi::Error::InvalidArgument(
        "mxfp8_fp8_blocked_gemm: K and N must be multiples of 128 and M of 16 (pad first)");
  if (a_scale.element_count() < static_cast<size_t>(m * (k / 128)) ||
      b_scale.element_count() < static_cast<size_t>((n / 128) * (k / 128)))
    return ffi::Error::InvalidArgument(
        "mxfp8_fp8_blocked_gemm: a_scale needs M*K/128 and b_scale (N/128)*(K/128) values");
  cudaDataType_t out_type;
  if (out->element_type() == ffi::DataType::BF16) {
    out_type = CUDA_R_16BF;
  } else if (out->element_type() == ffi::DataType::F32) {
    out_type = CUDA_R_32F;
  } else {
    return ffi::Error::InvalidArgument("mxfp8_fp8_blocked_gemm: out must be bf16 or f32");
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

  auto key = std::make_tuple(device, m, n, k, static_cast<int>(out_type));
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
          "mxfp8_fp8_blocked_gemm: cuBLASLt has no block-scaled FP8 algorithm for this GEMM "
          "on this GPU (it needs compute capability 9.x and CUDA >= 12.9)");
    found = h.algos.emplace(key, result.algo).first;
  }

  const size_t workspace_bytes = workspace->size_bytes();
  const float alpha = 1.0f, beta = 0.0f;
  LT_TRY(cublasLtMatmul(lt, desc.d, &alpha, b.untyped_data(), la.d, a.untyped_data(), lb.d, &beta,
                        out->untyped_data(), ld.d, out->untyped_data(), ld.d, &found->second,
                        workspace->untyped_data(), workspace_bytes, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mxfp8Fp8BlockedGemm, Fp8BlockedGemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()    // out
                                  .Ret<ffi::AnyBuffer>());  // workspace (uint8, discarded)
