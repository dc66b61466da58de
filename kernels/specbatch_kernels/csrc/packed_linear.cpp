// Prepacked oneDNN linears callable from a compiled graph: specbatch::packed_linear(x, handle).
//
// Why: a oneDNN-prepacked weight is an opaque MKLDNN tensor that torch.compile cannot take as a
// graph input, and inductor's own packing (freezing) makes graphs it will not cache on disk
// (every start would recompile for a minute). Here the packed weights live in a registry and
// the graph holds only an integer handle, so the graph is plain, cacheable, and calls the very
// kernel the eager path calls (mkldnn::_linear_pointwise, with the residual add as a post-op).
// An int8 linear (engine.quantization) is held the same way: its packed params (a torchbind
// object a graph cannot take either) behind a handle, run by quantized::linear_dynamic, as eager.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

namespace {

struct Entry {
  at::Tensor weight;  // MKLDNN-packed (float linears)
  std::optional<at::Tensor> bias;
  c10::IValue int8_params;  // quantized LinearPackedParamsBase (int8 linears), else None
  bool reduce_range = false;
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

// Boxed: its first argument is a torchbind object, which an unboxed signature cannot name
// without quantized headers torch does not install.
void register_int8_linear(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  bool reduce_range = stack->back().toBool();
  c10::IValue params = (*stack)[stack->size() - 2];
  stack->clear();
  int64_t handle;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry().push_back({at::Tensor(), std::nullopt, params, reduce_range});
    handle = static_cast<int64_t>(registry().size()) - 1;
  }
  stack->emplace_back(handle);
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
  TORCH_CHECK(e.weight.defined() || !e.int8_params.isNone(), "packed linear ", handle, " was released");
  return e;
}

at::Tensor packed_linear(const at::Tensor& x, int64_t handle, const std::optional<at::Tensor>& residual) {
  const Entry& e = entry(handle);
  auto input = x.contiguous();
  std::vector<c10::IValue> stack;
  if (!e.int8_params.isNone()) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic", "");
    auto rows = input.reshape({-1, input.size(-1)});
    stack = {rows, e.int8_params, e.reduce_range};
    op.callBoxed(&stack);
    auto out_shape = input.sizes().vec();
    out_shape.back() = stack[0].toTensor().size(-1);
    auto out = stack[0].toTensor().view(out_shape);
    return residual.has_value() ? out.add_(*residual) : out;
  }
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
  m.def("register_int8_linear(__torch__.torch.classes.quantized.LinearPackedParamsBase params, bool reduce_range) -> int",
        torch::CppFunction::makeFromBoxedFunction<&register_int8_linear>());
  m.def("release_packed_linear(int handle) -> ()", &release_packed_linear);
  m.def("packed_linear(Tensor x, int handle, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specbatch, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}
