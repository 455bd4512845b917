// What the CUDA binding (binding.cpp) and the CPU binding (cpu/binding.cpp) share, so that the same misuse
// raises the same Python exception with the same message format in both:
// - MRL_CHECK(cond, parts...): a bad argument (shape, dtype, device, stride, size limit) -> ValueError whose
//   message names the argument, the expected and the received value (c10::ValueError, TORCH_CHECK_VALUE);
// - a kernel that fails at launch is a RuntimeError (raised by each binding from the launcher's error string);
// - shape_str, the NaN poisoning of fresh outputs (tests), optional-tensor pointers.
// Header-only; each binding includes it once.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <limits>
#include <optional>
#include <sstream>
#include <string>

#define MRL_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

namespace mrl_binding {

inline std::string shape_str(const at::Tensor& t) {
  std::ostringstream o;
  o << t.sizes();
  return o.str();
}

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

// data pointer of an optional tensor, nullptr for None or an empty tensor
template <typename T>
const T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return (t && t->defined() && t->numel()) ? t->data_ptr<T>() : nullptr;
}

}  // namespace mrl_binding
