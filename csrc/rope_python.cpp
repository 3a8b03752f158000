// The Python module rope_ext._C: its init (importing it loads the library, which runs the
// TORCH_LIBRARY registrations) and eager entries of the rotary and fused-norm ops for the
// Python wrappers (rope_ext/_native.py, EAGER_ENTRIES).
//
// torch.ops.rope_ext.<op>.default(...) reaches the dispatcher through torch's generic path:
// each argument matched to the schema and boxed (torch::jit::createStackForSchema, toIValue),
// every argument searched for __torch_function__, then a boxed call: the overload's `_op`
// took 2.45-2.54 us for a one-row in-place apply_rotary_qk_ on a Zen 4, the entry below
// 0.85-0.88 (torch.ops.aten.copy_ of 256 bytes takes 1.7 us the torch.ops way). An entry
// here takes the op's arguments, all of them, in schema order, converts each directly and
// calls the op's typed handle: the same dispatcher call, through the same keys
// (autograd, ADInplaceOrView, Python dispatch modes, the profiler's record), with the GIL
// released around it and C++ errors and warnings raised as torch.ops raises them.
//
// An entry returns NotImplemented, running nothing, where torch's path has more to do or an
// argument is not of the plain form: a tensor subclass or a TorchFunctionMode
// (__torch_function__ handling), a SymInt offset, a tuple for mrope_section. The wrapper then
// calls the op through torch.ops.
#include <Python.h>  // first, as Python asks

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "autograd_common.h"

namespace rope_ext {
namespace {

using autograd::find_op;

// Converts a Python argument into the C++ value an op parameter takes; false where the
// argument is not in the plain form the entry handles (the wrapper then takes torch.ops).
// A torch.Tensor or nn.Parameter, not a subclass: their __torch_function__ is torch's own,
// which only a TorchFunctionMode makes matter (call checks for one).
bool convert(PyObject* obj, at::Tensor& out) {
  if (!THPVariable_CheckExact(obj)) {
    return false;
  }
  out = THPVariable_Unpack(obj);
  return true;
}

bool convert(PyObject* obj, std::optional<at::Tensor>& out) {
  if (obj == Py_None) {
    out.reset();
    return true;
  }
  return convert(obj, out.emplace());
}

bool convert(PyObject* obj, int64_t& out) {
  if (!PyLong_CheckExact(obj)) {  // not bool, not a SymInt
    return false;
  }
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(obj, &overflow);
  return overflow == 0;
}

bool convert(PyObject* obj, c10::SymInt& out) {
  int64_t value = 0;
  if (!convert(obj, value)) {
    return false;
  }
  out = c10::SymInt(value);
  return true;
}

bool convert(PyObject* obj, bool& out) {
  if (obj != Py_True && obj != Py_False) {
    return false;
  }
  out = obj == Py_True;
  return true;
}

bool convert(PyObject* obj, double& out) {
  if (!PyFloat_CheckExact(obj) && !PyLong_CheckExact(obj)) {
    return false;
  }
  out = PyFloat_AsDouble(obj);  // an int too large for a double raises OverflowError
  if (out == -1.0 && PyErr_Occurred() != nullptr) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool convert(PyObject* obj, std::optional<std::vector<int64_t>>& out) {
  if (obj == Py_None) {
    out.reset();
    return true;
  }
  if (!PyList_CheckExact(obj)) {
    return false;
  }
  std::vector<int64_t>& values = out.emplace(PyList_GET_SIZE(obj));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(obj); ++i) {
    if (!convert(PyList_GET_ITEM(obj, i), values[i])) {
      return false;
    }
  }
  return true;
}

bool convert(PyObject* obj, std::string& out) {
  if (!PyUnicode_CheckExact(obj)) {
    return false;
  }
  Py_ssize_t size = 0;
  const char* text = PyUnicode_AsUTF8AndSize(obj, &size);
  if (text == nullptr) {
    PyErr_Clear();
    return false;
  }
  out.assign(text, size);
  return true;
}

// What holds the converted argument of an op parameter of type T until the call.
template <typename T>
struct Holder {
  using type = std::decay_t<T>;
};
template <>
struct Holder<autograd::Mrope> {
  using type = std::optional<std::vector<int64_t>>;
};
template <>
struct Holder<c10::string_view> {
  using type = std::string;
};

template <typename T>
decltype(auto) pass(T& held) {
  if constexpr (std::is_same_v<T, std::optional<std::vector<int64_t>>>) {
    return held.has_value() ? autograd::Mrope(*held) : autograd::Mrope();
  } else if constexpr (std::is_same_v<T, std::string>) {
    return c10::string_view(held.data(), held.size());
  } else {
    return (held);
  }
}

PyObject* wrap(at::Tensor t) { return THPVariable_Wrap(std::move(t)); }

PyObject* wrap(std::tuple<at::Tensor, at::Tensor> t) {
  PyObject* pair = PyTuple_New(2);  // its items start NULL, so it frees cleanly half-filled
  if (pair == nullptr) {
    return nullptr;
  }
  PyObject* first = wrap(std::move(std::get<0>(t)));
  if (first == nullptr) {
    Py_DECREF(pair);
    return nullptr;
  }
  PyTuple_SET_ITEM(pair, 0, first);
  PyObject* second = wrap(std::move(std::get<1>(t)));
  if (second == nullptr) {
    Py_DECREF(pair);
    return nullptr;
  }
  PyTuple_SET_ITEM(pair, 1, second);
  return pair;
}

// Releases the GIL for the op's run, as torch.ops does.
struct WithoutGil {
  PyThreadState* state = PyEval_SaveThread();
  WithoutGil() = default;
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;
  ~WithoutGil() { PyEval_RestoreThread(state); }
};

template <typename R, typename... Args, size_t... I>
PyObject* call(const c10::TypedOperatorHandle<R(Args...)>& op, const char* name,
               PyObject* const* args, Py_ssize_t nargs, std::index_sequence<I...>) {
  if (nargs != static_cast<Py_ssize_t>(sizeof...(Args))) {
    PyErr_Format(PyExc_TypeError, "rope_ext._C.%s takes %zd arguments, got %zd", name,
                 static_cast<Py_ssize_t>(sizeof...(Args)), nargs);
    return nullptr;
  }
  std::tuple<typename Holder<Args>::type...> held;
  if (at::impl::torch_function_mode_enabled() || !(convert(args[I], std::get<I>(held)) && ...)) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  if constexpr (std::is_void_v<R>) {
    {
      WithoutGil no_gil;
      op.call(pass(std::get<I>(held))...);
    }
    Py_RETURN_NONE;
  } else {
    std::optional<R> result;
    {
      WithoutGil no_gil;
      result.emplace(op.call(pass(std::get<I>(held))...));
    }
    return wrap(std::move(*result));
  }
}

template <typename R, typename... Args>
PyObject* call(const c10::TypedOperatorHandle<R(Args...)>& op, const char* name,
               PyObject* const* args, Py_ssize_t nargs) {
  return call(op, name, args, nargs, std::index_sequence_for<Args...>());
}

#define ROPE_EXT_ENTRY(NAME, SIG)                                                  \
  PyObject* NAME##_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {     \
    HANDLE_TH_ERRORS                                                               \
    static const auto op = find_op<autograd::SIG>("rope_ext::" #NAME);             \
    return call(op, #NAME, args, nargs);                                           \
    END_HANDLE_TH_ERRORS                                                           \
  }

ROPE_EXT_ENTRY(apply_rotary, ApplySig)
ROPE_EXT_ENTRY(apply_rotary_, ApplyInplaceSig)
ROPE_EXT_ENTRY(apply_rotary_qk, ApplyQkSig)
ROPE_EXT_ENTRY(apply_rotary_qk_, ApplyQkInplaceSig)
ROPE_EXT_ENTRY(rms_norm_rotary_qk, NormSig)
ROPE_EXT_ENTRY(rms_norm_rotary_qk_, NormInplaceSig)
ROPE_EXT_ENTRY(rotary_kv_cache_update, KvCacheSig)
ROPE_EXT_ENTRY(rotary_kv_cache_update_, KvCacheInplaceSig)
#undef ROPE_EXT_ENTRY

#define ROPE_EXT_METHOD(NAME) \
  {#NAME, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&NAME##_entry)), \
   METH_FASTCALL, nullptr}
PyMethodDef methods[] = {
    ROPE_EXT_METHOD(apply_rotary),       ROPE_EXT_METHOD(apply_rotary_),
    ROPE_EXT_METHOD(apply_rotary_qk),    ROPE_EXT_METHOD(apply_rotary_qk_),
    ROPE_EXT_METHOD(rms_norm_rotary_qk), ROPE_EXT_METHOD(rms_norm_rotary_qk_),
    ROPE_EXT_METHOD(rotary_kv_cache_update), ROPE_EXT_METHOD(rotary_kv_cache_update_),
    {nullptr, nullptr, 0, nullptr},
};
#undef ROPE_EXT_METHOD

}  // namespace
}  // namespace rope_ext

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, rope_ext::methods,
  };
  return PyModule_Create(&module_def);
}
