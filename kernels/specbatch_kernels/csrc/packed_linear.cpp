// Prepacked oneDNN linears callable from a compiled graph: specbatch::packed_linear(x, handle).
//
// Why: a oneDNN-prepacked weight is an opaque MKLDNN tensor that torch.compile cannot take as a
// graph input, and inductor's own packing (freezing) makes graphs it will not cache on disk
// (every start would recompile for a minute). Here the packed weights live in a registry and
// the graph holds only an integer handle, so the graph is plain, cacheable, and calls the very
// kernel the eager path calls (mkldnn::_linear_pointwise, with the residual add as a post-op).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

namespace {

struct Entry {
  at::Tensor weight;  // MKLDNN-packed
  std::optional<at::Tensor> bias;
};

std::mutex registry_mutex;
std::vector<Entry>& registry() {
  static std::vector<Entry> entries;
  return entries;
}

int64_t register_packed_linear(const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().push_back({weight, bias});
  return static_cast<int64_t>(registry().size()) - 1;
}

void release_packed_linear(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(registry().size()), "bad packed-linear handle");
  registry()[handle] = Entry{};
}

const Entry& entry(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(registry().size()), "bad packed-linear handle");
  const Entry& e = registry()[handle];
  TORCH_CHECK(e.weight.defined(), "packed linear ", handle, " was released");
  return e;
}

at::Tensor packed_linear(const at::Tensor& x, int64_t handle, const std::optional<at::Tensor>& residual) {
  const Entry& e = entry(handle);
  auto input = x.contiguous();
  std::vector<c10::IValue> stack;
  if (residual.has_value()) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "binary");
    stack = {input, residual->contiguous(), e.weight, e.bias, std::string("add")};
    op.callBoxed(&stack);
  } else {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    stack = {input, e.weight, e.bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
             std::optional<std::string>()};
    op.callBoxed(&stack);
  }
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specbatch, m) {
  m.def("register_packed_linear(Tensor weight, Tensor? bias) -> int", &register_packed_linear);
  m.def("release_packed_linear(int handle) -> ()", &release_packed_linear);
  m.def("packed_linear(Tensor x, int handle, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specbatch, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}
