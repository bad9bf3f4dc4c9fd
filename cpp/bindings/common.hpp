// Helpers shared by the binding files: checked views of numpy arrays and the registration hooks.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <initializer_list>
#include <span>
#include <string>
#include <type_traits>

namespace ctxfold::bind {

namespace py = pybind11;
using namespace pybind11::literals;  // NOLINT: "name"_a keyword arguments

// A read-only view of a 1-D C-contiguous numpy array of exactly dtype T. Conversions are the
// caller's job, done once and visibly in Python; here a mismatch is a ValueError naming `what`.
template <class T>
std::span<const T> AsSpan(const py::array& a, const char* what) {
  if (a.ndim() != 1) {
    throw py::value_error(std::string(what) + ": expected a 1-D array, got " + std::to_string(a.ndim()) + " dimensions");
  }
  if (!a.dtype().is(py::dtype::of<T>())) {
    throw py::value_error(std::string(what) + ": expected dtype " + std::string(py::str(py::dtype::of<T>())) +
                          ", got " + std::string(py::str(a.dtype())) +
                          " (convert once with np.ascontiguousarray(x, dtype=...))");
  }
  if (!(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(what) + ": expected a C-contiguous array (use np.ascontiguousarray)");
  }
  return {static_cast<const T*>(a.data()), static_cast<size_t>(a.size())};
}

// A fresh 1-D numpy array that owns its buffer.
template <class T>
py::array_t<T> NewArray(size_t n) {
  return py::array_t<T>(static_cast<py::ssize_t>(n));
}

template <class T>
py::array_t<T> ToArray(std::span<const T> v) {
  auto out = NewArray<T>(v.size());
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// One `name=value` of a result's __repr__: ints, bools (as Python spells them), enums (as their
// number) or text already formatted.
struct ReprField {
  template <class T>
  ReprField(const char* field_name, const T& v) : name(field_name) {
    if constexpr (std::is_same_v<T, bool>) {
      value = v ? "True" : "False";
    } else if constexpr (std::is_enum_v<T>) {
      value = std::to_string(static_cast<int64_t>(v));
    } else if constexpr (std::is_integral_v<T>) {
      value = std::to_string(v);
    } else {
      value = std::string(v);
    }
  }
  const char* name;
  std::string value;
};

// "Type(a=1, b=2)": a result's __repr__, in the form of the keyword arguments that name its fields.
inline std::string Repr(const char* type, std::initializer_list<ReprField> fields) {
  std::string out = type;
  out += '(';
  const char* sep = "";
  for (const auto& f : fields) {
    out += sep;
    out += f.name;
    out += '=';
    out += f.value;
    sep = ", ";
  }
  out += ')';
  return out;
}

void BindEstimate(py::module_& m);
void BindLedger(py::module_& m);
void BindTail(py::module_& m);
void BindKvPlan(py::module_& m);
void BindJson(py::module_& m);

}  // namespace ctxfold::bind
