#include <pybind11/stl.h>

#include <string_view>
#include <vector>

#include "common.hpp"
#include "ctxfold/estimate.hpp"

namespace ctxfold::bind {
namespace {

Coefficients ToCoefficients(const py::array& a) {
  const auto v = AsSpan<double>(a, "coefficients");
  if (v.size() != kNumFeatures) {
    throw py::value_error("coefficients: expected " + std::to_string(kNumFeatures) + " values, got " +
                          std::to_string(v.size()));
  }
  Coefficients c{};
  std::copy(v.begin(), v.end(), c.begin());
  return c;
}

// The fallback bits of a calibration (uint64[FALLBACK_WORDS]) or None; the array must outlive the call.
const uint64_t* ToFallbackBits(const py::object& bits) {
  if (bits.is_none()) return nullptr;
  const auto v = AsSpan<uint64_t>(py::cast<py::array>(bits), "fallback_bits");
  if (v.size() != kFallbackWords) {
    throw py::value_error("fallback_bits: expected " + std::to_string(kFallbackWords) + " words (one bit per code point "
                          "of the basic plane), got " + std::to_string(v.size()));
  }
  return v.data();
}

// UTF-8 views of a list of str (or bytes), taken while the GIL is held. For compact ASCII strings
// CPython hands out its own buffer, so nothing is copied; the list keeps every buffer alive.
std::vector<std::string_view> Utf8Views(const py::list& texts) {
  std::vector<std::string_view> views;
  views.reserve(texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    PyObject* obj = texts[i].ptr();
    if (PyUnicode_Check(obj)) {
      Py_ssize_t n = 0;
      const char* p = PyUnicode_AsUTF8AndSize(obj, &n);
      if (p == nullptr) {
        PyErr_Clear();
        throw py::value_error("texts[" + std::to_string(i) + "]: not encodable as UTF-8 (lone surrogate?)");
      }
      views.emplace_back(p, static_cast<size_t>(n));
    } else if (PyBytes_Check(obj)) {
      views.emplace_back(PyBytes_AS_STRING(obj), static_cast<size_t>(PyBytes_GET_SIZE(obj)));
    } else {
      throw py::value_error("texts[" + std::to_string(i) + "]: expected str or bytes, got " +
                            std::string(py::str(py::type::handle_of(texts[i]).attr("__name__"))));
    }
  }
  return views;
}

std::string_view Utf8View(const py::handle& text) {
  py::list one;
  one.append(text);
  return Utf8Views(one)[0];
}

}  // namespace

void BindEstimate(py::module_& m) {
  m.attr("NUM_FEATURES") = static_cast<int>(kNumFeatures);
  m.attr("FALLBACK_WORDS") = static_cast<int>(kFallbackWords);
  m.attr("FEATURE_NAMES") = py::make_tuple("letters", "letter_runs", "upper_letters", "case_switches", "glued_letter_runs",
                                           "long_run_letters", "consonant_clusters", "digits", "digit_runs", "punct",
                                           "punct_runs", "spaces", "multi_space_runs", "tabs", "newlines",
                                           "space_newlines", "other2_chars", "other3_chars", "other4_chars", "cjk_chars",
                                           "fallback_bytes", "texts");

  m.def(
      "estimate_tokens",
      [](const py::object& text, const py::array& coefficients, const py::object& fallback_bits) {
        const Coefficients c = ToCoefficients(coefficients);
        const uint64_t* bits = ToFallbackBits(fallback_bits);  // the caller's array keeps them alive
        const std::string_view v = Utf8View(text);  // `text` keeps the buffer alive
        py::gil_scoped_release nogil;                // the loop touches no Python object
        return EstimateTokens(v, c, bits);
      },
      "text"_a, "coefficients"_a, "fallback_bits"_a = py::none(),
      "Estimated token count of one str or bytes (UTF-8) under the given coefficients (float64[NUM_FEATURES]) and\n"
      "fallback bits (uint64[FALLBACK_WORDS] or None: the basic-plane characters spelled byte by byte).");

  m.def(
      "estimate_batch",
      [](const py::list& texts, const py::array& coefficients, const py::object& fallback_bits) {
        const Coefficients c = ToCoefficients(coefficients);
        const uint64_t* bits = ToFallbackBits(fallback_bits);
        const auto views = Utf8Views(texts);
        auto out = NewArray<int64_t>(views.size());
        int64_t* dst = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          for (size_t i = 0; i < views.size(); ++i) dst[i] = EstimateTokens(views[i], c, bits);
        }
        return out;
      },
      "texts"_a, "coefficients"_a, "fallback_bits"_a = py::none(), "Estimated token counts of a list of str/bytes -> int64[len(texts)].");

  m.def(
      "feature_rows",
      [](const py::list& texts, const py::object& fallback_bits) {
        const uint64_t* bits = ToFallbackBits(fallback_bits);
        const auto views = Utf8Views(texts);
        py::array_t<int64_t> out({static_cast<py::ssize_t>(views.size()), static_cast<py::ssize_t>(kNumFeatures)});
        int64_t* dst = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          for (size_t i = 0; i < views.size(); ++i) {
            Features f{};
            AccumulateFeatures(views[i], f, bits);
            std::copy(f.begin(), f.end(), dst + i * kNumFeatures);
          }
        }
        return out;
      },
      "texts"_a, "fallback_bits"_a = py::none(), "Byte-class feature counts of each text -> int64[len(texts), NUM_FEATURES], for calibration.");
}

}  // namespace ctxfold::bind
