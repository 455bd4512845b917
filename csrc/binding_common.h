// What the CUDA binding (binding.cpp) and the CPU binding (cpu/binding.cpp) share, so that the same misuse
// raises the same Python exception with the same message format in both:
// - MRL_CHECK(cond, parts...): a bad argument (shape, dtype, device, stride, size limit) -> ValueError whose
//   message names the argument, the expected and the received value (c10::ValueError, TORCH_CHECK_VALUE);
// - MRL_RAISE_IF(err): a launcher's error string (a failed launch) -> RuntimeError;
// - shape_str, the NaN poisoning of fresh outputs (tests), optional-tensor pointers;
// - dbc_out_views: the shape / stride checks of scan_bwd's dbc_out and its dB / dC views.
// Header-only; each binding includes it once.
//
// No std::ostream formatting of numbers anywhere in a binding: in the CUDA extension as built on
// the H200 host, `ostream << long` (what TORCH_CHECK's c10::str and `o << t.sizes()` do) runs the
// extension's own hidden instantiation of libstdc++'s num_put, whose locale facet id was never registered,
// and dereferences garbage: every failed argument check ended the process with SIGSEGV instead of raising
// (cuda-gdb: std::basic_ostream::_M_insert<long> <- c10::operator<<(ostream, ArrayRef) <- shape_str).
// Messages are therefore built as one std::string with std::to_string (mrl_binding::cat) and handed to
// TORCH_CHECK_VALUE / TORCH_CHECK as a single string argument, which c10 passes through unformatted.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace mrl_binding {

inline void put(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
inline void put(std::string& s, T v) { s += std::to_string(v); }
inline void put(std::string& s, double v) { s += std::to_string(v); }
inline void put(std::string& s, c10::ScalarType t) { s += c10::toString(t); }
inline void put(std::string& s, const c10::Device& d) { s += d.str(); }
inline void put(std::string& s, c10::IntArrayRef a) {
  s += "[";
  for (size_t i = 0; i < a.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(a[i]);
  }
  s += "]";
}

// The parts concatenated into one string, without iostreams.
template <typename... Args>
inline std::string cat(const Args&... args) {
  std::string s;
  (put(s, args), ...);
  return s;
}

inline std::string shape_str(const at::Tensor& t) { return cat(t.sizes()); }

// Debug aid for the tests: outputs and workspaces start as NaN so an element a kernel forgets shows.
inline bool& poison_flag() {
  static bool on = false;
  return on;
}
inline void set_poison(bool on) { poison_flag() = on; }
inline at::Tensor new_empty(at::IntArrayRef shape, const at::TensorOptions& opt) {
  auto t = at::empty(shape, opt);
  if (poison_flag()) t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

#define MRL_CHECK(cond, ...)                                   \
  do {                                                         \
    if (C10_UNLIKELY(!(cond))) {                               \
      TORCH_CHECK_VALUE(false, ::mrl_binding::cat(__VA_ARGS__)); \
    }                                                          \
  } while (0)

#define MRL_RAISE_IF(err)                                                             \
  do {                                                                                \
    const char* e__ = (err);                                                          \
    if (e__ != nullptr) {                                                             \
      TORCH_CHECK(false, ::mrl_binding::cat("mamba_rl CUDA kernel failed: ", e__));   \
    }                                                                                 \
  } while (0)

// data pointer of an optional tensor, nullptr for None or an empty tensor
template <typename T>
const T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return (t && t->defined() && t->numel()) ? t->data_ptr<T>() : nullptr;
}

// scan_bwd's dbc_out, the gradient of the x_proj output [B*T, E], E = R + 2N (R = dt_rank >= 0, not otherwise
// known to the scan): unit column stride, rows at least E elements apart (none overlap). Its dB / dC columns
// [E - 2N, E - N) and [E - N, E) as [B, T, N] views (rows stride(0) apart). dtype and device: the caller's checks.
inline std::pair<at::Tensor, at::Tensor> dbc_out_views(const at::Tensor& t, int64_t B, int64_t T, int64_t N) {
  const int64_t BT = B * T;
  MRL_CHECK(t.dim() == 2 && t.size(0) == BT && t.size(1) >= 2 * N, "selective_scan: dbc_out: expected shape [", BT,
            ", dt_rank + ", 2 * N, "], got ", shape_str(t));
  const int64_t E = t.size(1);
  MRL_CHECK(t.stride(1) == 1 && (BT == 1 || t.stride(0) >= E), "selective_scan: dbc_out: expected strides [>= ", E,
            ", 1], got ", t.strides());
  return {t.narrow(1, E - 2 * N, N).view({B, T, N}), t.narrow(1, E - N, N).view({B, T, N})};
}

}  // namespace mrl_binding
