#include <string_view>

#include "common.hpp"
#include "ctxfold/jsonscan.hpp"

namespace ctxfold::bind {

void BindJson(py::module_& m) {
  m.def(
      "has_long_number",
      [](const py::bytes& json, size_t min_digits) {
        const std::string_view v(PyBytes_AS_STRING(json.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(json.ptr())));
        return HasLongNumber(v, min_digits);
      },
      "json"_a, "min_digits"_a,
      "Whether JSON text (UTF-8 bytes) holds a run of at least min_digits digits outside its strings.");
}

}  // namespace ctxfold::bind
