// zero_triton._C entry point: argument checks shared by every device, then the CPU or
// CUDA launcher. Every check runs before anything is written, so a refused call leaves
// all tensors untouched.
#include "adam.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <sstream>
#include <utility>
#include <vector>

namespace zero_triton {
namespace {

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << " tensor of shape " << t.sizes() << " on " << t.device();
  if (t.layout() != at::kStrided) os << " with layout " << t.layout();
  else if (!t.is_contiguous()) os << ", strides " << t.strides() << " (not contiguous)";
  return os.str();
}

std::string dtype_list(const std::vector<at::ScalarType>& dtypes) {
  std::ostringstream os;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    if (i) os << (i + 1 == dtypes.size() ? " or " : ", ");
    os << dtypes[i];
  }
  return os.str();
}

// A flat 1-D buffer: the right dtype, dense, contiguous (in-place targets are never
// copied to make them contiguous: the update would land in the copy).
void check_flat(const at::Tensor& t, const char* name, const std::vector<at::ScalarType>& dtypes,
                const at::Tensor& param) {
  bool ok_dtype = false;
  for (auto d : dtypes) ok_dtype |= t.scalar_type() == d;
  TORCH_CHECK_TYPE(ok_dtype && t.layout() == at::kStrided && t.is_contiguous(), "`", name,
                   "` must be ", dtype_list(dtypes), " and contiguous, got ", describe(t));
  TORCH_CHECK(t.dim() == 1, "`", name, "` must be a flat 1-D tensor, got ", describe(t),
              "; pass t.view(-1)");
  TORCH_CHECK(t.device() == param.device(), "`", name, "` is on ", t.device(),
              " but `param` is on ", param.device(), "; all tensors must be on one device");
  TORCH_CHECK(t.numel() == param.numel(), "`", name, "` has ", t.numel(),
              " elements but `param` has ", param.numel(), "; they must match");
}

// A 1-element float32 device scalar (lr, step, ...), read by the kernel itself.
void check_scalar(const at::Tensor& t, const char* name, const at::Tensor& param) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat && t.layout() == at::kStrided && t.numel() == 1,
                   "`", name, "` must be a 1-element float32 tensor, got ", describe(t));
  TORCH_CHECK(t.device() == param.device(), "`", name, "` is on ", t.device(),
              " but `param` is on ", param.device(),
              "; keep it on the parameter's device (it is read there, without a host sync)");
}

void check_no_overlap(const std::vector<std::pair<const char*, const at::Tensor*>>& written,
                      const std::vector<std::pair<const char*, const at::Tensor*>>& all) {
  for (const auto& w : written) {
    const auto* wb = static_cast<const char*>(w.second->const_data_ptr());
    const auto* we = wb + w.second->nbytes();
    for (const auto& o : all) {
      if (o.second == w.second || o.second->numel() == 0 || w.second->numel() == 0) continue;
      const auto* ob = static_cast<const char*>(o.second->const_data_ptr());
      const auto* oe = ob + o.second->nbytes();
      TORCH_CHECK(we <= ob || oe <= wb, "`", w.first, "` and `", o.first,
                  "` share memory; each state tensor needs its own storage");
    }
  }
}

// The checks every step shares, whatever its moments' format (each binding checks its
// moments after these).
void check_step_args(const at::Tensor& param, const at::Tensor& grad,
                     const std::optional<at::Tensor>& param_lp, const at::Tensor& step,
                     const at::Tensor& lr, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& clip_coef, double beta1,
                     double beta2, double eps, double weight_decay,
                     bool stochastic, int64_t index,
                     const std::optional<at::Tensor>& remainder) {
  TORCH_CHECK(!(stochastic && remainder.has_value()), "stochastic=True and `remainder` are two "
              "ways of stepping a bfloat16 parameter without an fp32 master; pass one");
  if (stochastic || remainder) {  // the bf16 parameter itself, no fp32 master
    const char* mode = stochastic ? "stochastic=True" : "a `remainder`";
    TORCH_CHECK_TYPE(param.scalar_type() == at::kBFloat16 && param.layout() == at::kStrided &&
                         param.is_contiguous(),
                     "`param` must be bfloat16 and contiguous with ", mode, " (the parameter "
                     "itself, no fp32 master), got ", describe(param));
    TORCH_CHECK(!param_lp.has_value(), "`param_lp` must be None with ", mode, ": `param` "
                "is the bfloat16 parameter itself");
  } else {
    TORCH_CHECK_TYPE(param.scalar_type() == at::kFloat && param.layout() == at::kStrided &&
                         param.is_contiguous(),
                     "`param` must be float32 and contiguous, got ", describe(param),
                     "; keep an fp32 master copy for low-precision parameters");
  }
  TORCH_CHECK(param.dim() == 1, "`param` must be a flat 1-D tensor, got ", describe(param),
              "; pass t.view(-1)");
  const auto dev = param.device().type();
#ifdef ZERO_TRITON_WITH_CUDA
  TORCH_CHECK(dev == at::kCPU || dev == at::kCUDA, "`param` is on ", param.device(),
              "; zero_triton._C runs on cpu and cuda tensors");
#else
  TORCH_CHECK(dev == at::kCPU, "`param` is on ", param.device(),
              "; this build of zero_triton._C has CPU kernels only (rebuild with "
              "ZERO_TRITON_BUILD_EXT=1 on a machine with nvcc for CUDA)");
#endif
  check_flat(grad, "grad", {at::kFloat, at::kHalf, at::kBFloat16}, param);
  if (param_lp) check_flat(*param_lp, "param_lp", {at::kHalf, at::kBFloat16}, param);
  if (remainder) check_flat(*remainder, "remainder", {at::kShort, at::kChar}, param);
  check_scalar(step, "step", param);
  check_scalar(lr, "lr", param);
  if (grad_scale) check_scalar(*grad_scale, "grad_scale", param);
  if (found_inf) check_scalar(*found_inf, "found_inf", param);
  if (clip_coef) check_scalar(*clip_coef, "clip_coef", param);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "`beta1` must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "`beta2` must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(eps >= 0.0 && std::isfinite(eps), "`eps` must be >= 0 and finite, got ",
                    eps);
  TORCH_CHECK_VALUE(weight_decay >= 0.0 && std::isfinite(weight_decay),
                    "`weight_decay` must be >= 0 and finite, got ", weight_decay);
  TORCH_CHECK_VALUE(index >= 0, "`index` must be >= 0 (the canonical index of element 0), got ",
                    index);
}

// Refuses tensors a step writes that share memory with another of its tensors: `moments`
// (the format's), with the parameter, its low-precision copy and the gradient.
void check_writes(const AdamStep& s,
                  std::vector<std::pair<const char*, const at::Tensor*>> written) {
  written.insert(written.begin(), {"param", &s.param});
  if (s.param_lp) written.push_back({"param_lp", &*s.param_lp});
  if (s.param_remainder) written.push_back({"remainder", &*s.param_remainder});
  auto all = written;
  all.push_back({"grad", &s.grad});
  check_no_overlap(written, all);
}

// The checked arguments every step shares (check_step_args), as a step without its
// moments: each binding checks and adds its format's.
AdamStep checked_step(const at::Tensor& param, const at::Tensor& grad,
                      const std::optional<at::Tensor>& param_lp, const at::Tensor& step,
                      const at::Tensor& lr, double beta1, double beta2, double eps,
                      double weight_decay, bool adamw, bool maximize,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& clip_coef, bool stochastic, int64_t seed,
                      int64_t index, const std::optional<at::Tensor>& remainder) {
  check_step_args(param, grad, param_lp, step, lr, grad_scale, found_inf, clip_coef, beta1,
                  beta2, eps, weight_decay, stochastic, index, remainder);
  AdamStep s;
  s.param = param;
  s.grad = grad;
  s.param_lp = param_lp;
  s.step = step;
  s.lr = lr;
  s.grad_scale = grad_scale;
  s.found_inf = found_inf;
  s.clip_coef = clip_coef;
  s.beta1 = beta1;
  s.beta2 = beta2;
  s.eps = eps;
  s.weight_decay = weight_decay;
  s.adamw = adamw;
  s.maximize = maximize;
  s.stochastic_param = stochastic;
  s.param_remainder = remainder;
  s.seed = seed;
  s.index = index;
  return s;
}

void launch(const AdamStep& s) {
  const auto dev = s.param.device().type();
#ifdef ZERO_TRITON_WITH_CUDA
  if (dev == at::kCUDA) {
    adam_step_cuda(s);
    return;
  }
#endif
  (void)dev;
  adam_step_cpu(s);
}

void adam_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
               std::optional<at::Tensor> max_exp_avg_sq, std::optional<at::Tensor> param_lp,
               at::Tensor step, at::Tensor lr, double beta1, double beta2, double eps,
               double weight_decay, bool adamw, bool amsgrad, bool maximize,
               std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf,
               std::optional<at::Tensor> clip_coef, bool stochastic, int64_t seed,
               int64_t index, std::optional<at::Tensor> remainder) {
  AdamStep s = checked_step(param, grad, param_lp, step, lr, beta1, beta2, eps, weight_decay,
                            adamw, maximize, grad_scale, found_inf, clip_coef, stochastic, seed,
                            index, remainder);
  check_flat(exp_avg, "exp_avg", {at::kFloat}, param);
  check_flat(exp_avg_sq, "exp_avg_sq", {at::kFloat}, param);
  if (amsgrad) {
    TORCH_CHECK(max_exp_avg_sq.has_value(),
                "`max_exp_avg_sq` is required with amsgrad=True; pass a float32 tensor like "
                "`exp_avg_sq`, zero-initialised");
    check_flat(*max_exp_avg_sq, "max_exp_avg_sq", {at::kFloat}, param);
  } else {
    TORCH_CHECK(!max_exp_avg_sq.has_value(),
                "`max_exp_avg_sq` was given but amsgrad=False; pass None or set amsgrad=True");
  }

  std::vector<std::pair<const char*, const at::Tensor*>> moments = {
      {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}};
  if (amsgrad) moments.push_back({"max_exp_avg_sq", &*max_exp_avg_sq});
  check_writes(s, moments);

  s.exp_avg = exp_avg;
  s.exp_avg_sq = exp_avg_sq;
  s.max_exp_avg_sq = max_exp_avg_sq;
  s.amsgrad = amsgrad;
  launch(s);
}

// moments="int8": the same step over 8-bit codes and their blocks' scales (quant.h).
void adam8_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg_codes,
                at::Tensor exp_avg_sq_codes, at::Tensor scales, std::optional<at::Tensor> param_lp,
                at::Tensor step, at::Tensor lr, double beta1, double beta2, double eps,
                double weight_decay, bool adamw, bool maximize,
                std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf,
                std::optional<at::Tensor> clip_coef, bool stochastic, int64_t seed,
                int64_t index, std::optional<at::Tensor> remainder) {
  AdamStep s = checked_step(param, grad, param_lp, step, lr, beta1, beta2, eps, weight_decay,
                            adamw, maximize, grad_scale, found_inf, clip_coef, stochastic, seed,
                            index, remainder);
  check_flat(exp_avg_codes, "exp_avg_codes", {at::kChar}, param);
  check_flat(exp_avg_sq_codes, "exp_avg_sq_codes", {at::kByte}, param);
  const int64_t blocks = (param.numel() + 255) / 256;
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                       scales.dim() == 2 && scales.size(0) == blocks && scales.size(1) == 2,
                   "`scales` must be a contiguous float32 [", blocks, ", 2] tensor (first, "
                   "second moment per block of 256), got ", describe(scales));
  TORCH_CHECK(scales.device() == param.device(), "`scales` is on ", scales.device(),
              " but `param` is on ", param.device());
  check_writes(s,
               {{"exp_avg_codes", &exp_avg_codes}, {"exp_avg_sq_codes", &exp_avg_sq_codes},
                {"scales", &scales}});
  s.exp_avg_codes = exp_avg_codes;
  s.exp_avg_sq_codes = exp_avg_sq_codes;
  s.scales = scales;
  launch(s);
}

// moments="int4": the same step over 4-bit codes, two to a byte, and their blocks'
// bfloat16 scales (quant.h). CPU only (the GPUs' int4 step is in torch ops).
void adam4_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg_nibbles,
                at::Tensor exp_avg_sq_nibbles, at::Tensor scales, std::optional<at::Tensor> param_lp,
                at::Tensor step, at::Tensor lr, double beta1, double beta2, double eps,
                double weight_decay, bool adamw, bool maximize,
                std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf,
                std::optional<at::Tensor> clip_coef, bool stochastic, int64_t seed,
                int64_t index, std::optional<at::Tensor> remainder) {
  AdamStep s = checked_step(param, grad, param_lp, step, lr, beta1, beta2, eps, weight_decay,
                            adamw, maximize, grad_scale, found_inf, clip_coef, stochastic, seed,
                            index, remainder);
  TORCH_CHECK(param.device().is_cpu(), "adam4_step runs on CPU tensors; `param` is on ",
              param.device());
  const int64_t bytes = (param.numel() + 1) / 2;
  const int64_t blocks = (param.numel() + 127) / 128;
  for (auto [t, name] : {std::pair{&exp_avg_nibbles, "exp_avg_nibbles"},
                         std::pair{&exp_avg_sq_nibbles, "exp_avg_sq_nibbles"}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kByte && t->is_contiguous() && t->dim() == 1 &&
                         t->numel() == bytes && t->device() == param.device(),
                     "`", name, "` must be a contiguous uint8 [", bytes, "] tensor (two codes "
                     "a byte) on `param`'s device, got ", describe(*t));
  }
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                       scales.dim() == 2 && scales.size(0) == blocks && scales.size(1) == 2 &&
                       scales.device() == param.device(),
                   "`scales` must be a contiguous bfloat16 [", blocks, ", 2] tensor (first, "
                   "second moment per block of 128) on `param`'s device, got ", describe(scales));
  check_writes(s,
               {{"exp_avg_nibbles", &exp_avg_nibbles}, {"exp_avg_sq_nibbles", &exp_avg_sq_nibbles},
                {"scales", &scales}});
  s.exp_avg_nibbles = exp_avg_nibbles;
  s.exp_avg_sq_nibbles = exp_avg_sq_nibbles;
  s.scales_bf16 = scales;
  launch(s);
}

// moments="bf16": the same step over bfloat16 moments, rounded stochastically by a
// generator keyed by (seed, step, moment, index + element) (rounding.h).
void adam_bf16_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                    std::optional<at::Tensor> param_lp, at::Tensor step, at::Tensor lr,
                    double beta1, double beta2, double eps, double weight_decay, bool adamw,
                    bool maximize, std::optional<at::Tensor> grad_scale,
                    std::optional<at::Tensor> found_inf, std::optional<at::Tensor> clip_coef,
                    int64_t seed, int64_t index, bool stochastic,
                    std::optional<at::Tensor> remainder) {
  AdamStep s = checked_step(param, grad, param_lp, step, lr, beta1, beta2, eps, weight_decay,
                            adamw, maximize, grad_scale, found_inf, clip_coef, stochastic, seed,
                            index, remainder);
  check_flat(exp_avg, "exp_avg", {at::kBFloat16}, param);
  check_flat(exp_avg_sq, "exp_avg_sq", {at::kBFloat16}, param);
  check_writes(s, {{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}});
  s.exp_avg_bf16 = exp_avg;
  s.exp_avg_sq_bf16 = exp_avg_sq;
  launch(s);
}

// Index of the first parameter whose .grad is not its view of the flat grad buffer, or
// -1. The per-step check of FlatShard.sync_grads in one C loop: Python's `p.grad is
// view` costs ~100 ns a tensor, which dominates a step over thousands of small tensors.
int64_t first_foreign_grad(const pybind11::list& params, const pybind11::list& views) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  TORCH_CHECK(PyList_GET_SIZE(views.ptr()) == n, "first_foreign_grad: `params` has ", n,
              " entries, `views` ", PyList_GET_SIZE(views.ptr()));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* p = PyList_GET_ITEM(params.ptr(), i);
    PyObject* v = PyList_GET_ITEM(views.ptr(), i);
    if (!THPVariable_Check(p) || !THPVariable_Check(v)) return i;
    const at::Tensor& grad = THPVariable_Unpack(p).grad();
    if (!grad.defined() || !grad.is_same(THPVariable_Unpack(v))) return i;
  }
  return -1;
}

// The per-step check of a flat buffer in one C loop (Python's `p.grad is view` costs
// ~100 ns a tensor, which dominates a step over thousands of small tensors). Returns
// (first parameter that no longer lives at its view of the flat parameter buffer, i.e.
// `model.to(dtype or device)` replaced its storage, or -1; first parameter whose .grad is
// not its view of the flat grad buffer, or -1). A view and the parameter re-homed onto
// it share one StorageImpl and offset: comparing those is cheaper than data pointers.
std::pair<int64_t, int64_t> flat_status(const pybind11::list& params,
                                       const pybind11::list& param_views,
                                       const pybind11::list& grad_views) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  TORCH_CHECK(PyList_GET_SIZE(param_views.ptr()) == n && PyList_GET_SIZE(grad_views.ptr()) == n,
              "flat_status: `params`, `param_views` and `grad_views` differ in length");
  int64_t moved = -1, foreign = -1;
  for (Py_ssize_t i = 0; i < n && (moved < 0 || foreign < 0); ++i) {
    PyObject* p = PyList_GET_ITEM(params.ptr(), i);
    PyObject* v = PyList_GET_ITEM(param_views.ptr(), i);
    PyObject* gv = PyList_GET_ITEM(grad_views.ptr(), i);
    if (!THPVariable_Check(p) || !THPVariable_Check(v) || !THPVariable_Check(gv)) {
      if (moved < 0) moved = i;
      if (foreign < 0) foreign = i;
      continue;
    }
    const at::Tensor& param = THPVariable_Unpack(p);
    if (moved < 0) {
      const c10::TensorImpl* a = param.unsafeGetTensorImpl();
      const c10::TensorImpl* b = THPVariable_Unpack(v).unsafeGetTensorImpl();
      if (!a->has_storage() || a->unsafe_storage().unsafeGetStorageImpl() !=
              b->unsafe_storage().unsafeGetStorageImpl() ||
          a->storage_offset() != b->storage_offset() || a->dtype() != b->dtype())
        moved = i;
    }
    if (foreign < 0) {
      const at::Tensor& grad = param.grad();
      if (!grad.defined() || !grad.is_same(THPVariable_Unpack(gv))) foreign = i;
    }
  }
  return {moved, foreign};
}

// The first parameter whose version counter is not seen[i] (written by the user since
// the optimizer last looked: zero_triton.state.watch), or -1: one pass in C instead of a Python
// attribute read per parameter on every step.
int64_t first_written(const pybind11::list& params, const pybind11::list& seen) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  TORCH_CHECK(PyList_GET_SIZE(seen.ptr()) == n,
              "first_written: `params` and `seen` differ in length");
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* p = PyList_GET_ITEM(params.ptr(), i);
    if (!THPVariable_Check(p)) return i;
    const long long version = static_cast<long long>(
        THPVariable_Unpack(p).unsafeGetTensorImpl()->version_counter().current_version());
    const long long was = PyLong_AsLongLong(PyList_GET_ITEM(seen.ptr(), i));
    if (was == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return i;
    }
    if (version != was) return i;
  }
  return -1;
}

}  // namespace

namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kFloat32;
    case at::kHalf: return kFloat16;
    case at::kBFloat16: return kBFloat16;
    default: return kNone;
  }
}

const float* optional_ptr(const std::optional<at::Tensor>& t) {
  return t ? t->const_data_ptr<float>() : nullptr;
}

}  // namespace

AdamArgs args_of(const AdamStep& s) {
  AdamArgs a{};
  const bool own_param = s.stochastic_param || s.param_remainder;  // bf16, no fp32 master
  a.param = own_param ? nullptr : s.param.data_ptr<float>();
  a.grad = s.grad.const_data_ptr();
  a.exp_avg = s.exp_avg.defined() ? s.exp_avg.data_ptr<float>() : nullptr;
  a.exp_avg_sq = s.exp_avg_sq.defined() ? s.exp_avg_sq.data_ptr<float>() : nullptr;
  a.exp_avg_codes = s.exp_avg_codes ? s.exp_avg_codes->data_ptr<int8_t>() : nullptr;
  a.exp_avg_sq_codes = s.exp_avg_sq_codes ? s.exp_avg_sq_codes->data_ptr<uint8_t>() : nullptr;
  a.scales = s.scales ? s.scales->data_ptr<float>() : nullptr;
  a.exp_avg_nibbles = s.exp_avg_nibbles ? s.exp_avg_nibbles->data_ptr<uint8_t>() : nullptr;
  a.exp_avg_sq_nibbles = s.exp_avg_sq_nibbles ? s.exp_avg_sq_nibbles->data_ptr<uint8_t>() : nullptr;
  a.scales_bf16 = s.scales_bf16
      ? reinterpret_cast<uint16_t*>(s.scales_bf16->data_ptr<at::BFloat16>()) : nullptr;
  a.exp_avg_bf16 = s.exp_avg_bf16
      ? reinterpret_cast<uint16_t*>(s.exp_avg_bf16->data_ptr<at::BFloat16>()) : nullptr;
  a.exp_avg_sq_bf16 = s.exp_avg_sq_bf16
      ? reinterpret_cast<uint16_t*>(s.exp_avg_sq_bf16->data_ptr<at::BFloat16>()) : nullptr;
  a.seed = uint32_t(s.seed);
  a.index = s.index;
  a.max_exp_avg_sq = s.amsgrad ? s.max_exp_avg_sq->data_ptr<float>() : nullptr;
  a.param_lp = own_param ? s.param.data_ptr() : s.param_lp ? s.param_lp->data_ptr() : nullptr;
  a.param_remainder = s.param_remainder ? s.param_remainder->data_ptr() : nullptr;
  a.remainder8 = s.param_remainder && s.param_remainder->scalar_type() == at::kChar;
  a.numel = s.param.numel();
  a.grad_dtype = dtype_code(s.grad.scalar_type());
  a.param_lp_dtype = own_param ? kBFloat16
                     : s.param_lp ? dtype_code(s.param_lp->scalar_type()) : kNone;
  a.stochastic_param = s.stochastic_param;
  a.amsgrad = s.amsgrad;
  a.adamw = s.adamw;
  a.maximize = s.maximize;
  a.beta1 = s.beta1;
  a.beta2 = s.beta2;
  a.eps = s.eps;
  a.weight_decay = s.weight_decay;
  a.step = s.step.const_data_ptr<float>();
  a.lr = s.lr.const_data_ptr<float>();
  a.grad_scale = optional_ptr(s.grad_scale);
  a.found_inf = optional_ptr(s.found_inf);
  a.clip_coef = optional_ptr(s.clip_coef);
  return a;
}

}  // namespace zero_triton

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "zero_triton native kernels: one fused Adam/AdamW step per call";
  m.def("adam_step", &zero_triton::adam_step, py::arg("param"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("max_exp_avg_sq"),
        py::arg("param_lp"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"),
        py::arg("amsgrad"), py::arg("maximize"), py::arg("grad_scale") = py::none(),
        py::arg("found_inf") = py::none(), py::arg("clip_coef") = py::none(),
        py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("index") = 0,
        py::arg("remainder") = py::none(),
        // The step touches no Python objects; let other threads run meanwhile.
        py::call_guard<py::gil_scoped_release>(),
        R"doc(One fused Adam/AdamW step, in place, one launch (CPU or CUDA).

param: float32 [n] (fp32 master or parameter), updated.
grad: float32/float16/bfloat16 [n], read only.
exp_avg, exp_avg_sq: float32 [n], updated.
max_exp_avg_sq: float32 [n] iff amsgrad, else None; updated.
param_lp: float16/bfloat16 [n] or None; receives param rounded to nearest even.
step: float32 [1], the step number t already incremented; lr: float32 [1].
grad_scale, found_inf, clip_coef: float32 [1] or None. g = g / grad_scale * clip_coef;
a nonzero found_inf skips the step without writing anything.
All tensors on param's device; scalars are read there (no host sync on CUDA).
stochastic=True (master_weights="stochastic"): `param` is the bfloat16 parameter itself
(no master, param_lp None), rounded back stochastically by a hash of (seed, step, the
parameter's stream, index + i) (zero_triton/kernels/rounding.py).
remainder (master_weights="remainder"): int16 [n], the low 16 bits of the fp32 master
whose high half is `param` (bfloat16, param_lp None); both updated; int8 [n]
(master_weights="remainder8"): bits 8-15 of a 24-bit master, the step's result rounded
to 24 bits (zero_triton/kernels/remainder.py).)doc");
  m.def("adam8_step", &zero_triton::adam8_step, py::arg("param"), py::arg("grad"),
        py::arg("exp_avg_codes"), py::arg("exp_avg_sq_codes"), py::arg("scales"),
        py::arg("param_lp"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"),
        py::arg("maximize"), py::arg("grad_scale") = py::none(),
        py::arg("found_inf") = py::none(), py::arg("clip_coef") = py::none(),
        py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("index") = 0,
        py::arg("remainder") = py::none(), py::call_guard<py::gil_scoped_release>(),
        R"doc(adam_step over int8 moments (moments="int8"), in place (CPU or CUDA).

exp_avg_codes: int8 [n]; exp_avg_sq_codes: uint8 [n]; scales: float32 [ceil(n/256), 2],
each block's (first, second) scale (zero_triton/kernels/quant.py defines the codes).
The range starts on a block boundary. Everything else as adam_step (no amsgrad).)doc");
  m.def("adam4_step", &zero_triton::adam4_step, py::arg("param"), py::arg("grad"),
        py::arg("exp_avg_nibbles"), py::arg("exp_avg_sq_nibbles"), py::arg("scales"),
        py::arg("param_lp"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"),
        py::arg("maximize"), py::arg("grad_scale") = py::none(),
        py::arg("found_inf") = py::none(), py::arg("clip_coef") = py::none(),
        py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("index") = 0,
        py::arg("remainder") = py::none(), py::call_guard<py::gil_scoped_release>(),
        R"doc(adam_step over 4-bit moments (moments="int4"), in place (CPU).

exp_avg_nibbles, exp_avg_sq_nibbles: uint8 [ceil(n/2)], two codes a byte (element 2k
the low nibble); scales: bfloat16 [ceil(n/128), 2], each block's (first, second) scale
(zero_triton/kernels/quant4.py defines the codes). The range starts on a block
boundary. Everything else as adam_step (no amsgrad).)doc");
  m.def("adam_bf16_step", &zero_triton::adam_bf16_step, py::arg("param"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param_lp"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw"), py::arg("maximize"),
        py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(),
        py::arg("clip_coef") = py::none(), py::arg("seed") = 0, py::arg("index") = 0,
        py::arg("stochastic") = false, py::arg("remainder") = py::none(),
        py::call_guard<py::gil_scoped_release>(),
        R"doc(adam_step over bfloat16 moments (moments="bf16"), in place (CPU or CUDA).

exp_avg, exp_avg_sq: bfloat16 [n], written back by stochastic rounding whose bits hash
(seed, step, moment, index + i) (zero_triton/kernels/rounding.py). No amsgrad.)doc");
  m.def("first_foreign_grad", &zero_triton::first_foreign_grad, py::arg("params"),
        py::arg("views"),
        "Index of the first parameter whose .grad is not views[i] (same tensor), or -1.");
  m.def("flat_status", &zero_triton::flat_status, py::arg("params"), py::arg("param_views"),
        py::arg("grad_views"),
        "(first parameter no longer at its view of the flat buffer, first parameter whose "
        ".grad is not its grad view), each -1 when there is none.");
  m.def("first_written", &zero_triton::first_written, py::arg("params"), py::arg("seen"),
        "Index of the first parameter whose version counter differs from seen[i], or -1.");
  m.def("cpu_isa", &zero_triton::cpu_isa,
        "Instruction-set variant used by the CPU kernel: 'avx512', 'avx2' or 'default'.");
  m.def("_set_cpu_isa", &zero_triton::set_cpu_isa, py::arg("isa"),
        "Test hook: force a CPU variant ('default', 'avx2', 'avx512'); '' = automatic.");
#ifdef ZERO_TRITON_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
