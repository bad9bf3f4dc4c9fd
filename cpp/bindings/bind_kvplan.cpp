#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

#include "common.hpp"
#include "ctxfold/kvplan.hpp"

namespace ctxfold::bind {

namespace {

using Range = std::pair<int64_t, int64_t>;

// The span and range lists are handed to numpy as views of the plan's own vectors: int64 rows of
// 3 (old_begin, new_begin, num_tokens) and 2 (begin, end). That needs exactly those layouts.
static_assert(std::is_standard_layout_v<ShiftSpan> && sizeof(ShiftSpan) == 3 * sizeof(int64_t) &&
              offsetof(ShiftSpan, old_begin) == 0 && offsetof(ShiftSpan, new_begin) == sizeof(int64_t) &&
              offsetof(ShiftSpan, num_tokens) == 2 * sizeof(int64_t));
static_assert(std::is_standard_layout_v<Range> && sizeof(Range) == 2 * sizeof(int64_t) &&
              offsetof(Range, first) == 0 && offsetof(Range, second) == sizeof(int64_t));

// A read-only int64[rows, cols] view of `rows` records of `cols` int64 each at `data`, kept alive
// by `owner` (the Python KvPlan, whose vectors never change after it is made: every field is
// read-only). Zero-copy, and numpy refuses writes to it.
py::array_t<int64_t> RecordsView(const void* data, size_t rows, py::ssize_t cols, const py::handle& owner) {
  const auto item = static_cast<py::ssize_t>(sizeof(int64_t));
  py::array_t<int64_t> out({static_cast<py::ssize_t>(rows), cols}, {cols * item, item},
                           static_cast<const int64_t*>(data), owner);
  // What ndarray.setflags(write=False) does, without a Python method call per view (pybind11's own
  // Eigen casters clear the flag the same way).
  py::detail::array_proxy(out.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return out;
}

// "<1 span>", "<3 spans>": how many records a list holds, for a repr.
std::string Count(size_t n, const char* noun) {
  return "<" + std::to_string(n) + " " + noun + (n == 1 ? ">" : "s>");
}

}  // namespace

void BindKvPlan(py::module_& m) {
  py::class_<KvPlan>(m, "KvPlan", "KV re-sync plan from a cached to a rebuilt token sequence (read-only).")
      .def_readonly("common_prefix_tokens", &KvPlan::common_prefix_tokens, "Exact longest common prefix.")
      .def_readonly("reuse_tokens", &KvPlan::reuse_tokens,
                    "KV kept in place: the prefix capped at len(rebuilt) - 1, rounded down to a page.")
      .def_readonly("page_size_tokens", &KvPlan::page_size_tokens, "Engine KV page size used for the rounding.")
      .def_readonly("pages_kept", &KvPlan::pages_kept, "Logical pages [0, pages_kept) keep their blocks.")
      .def_readonly("cached_pages", &KvPlan::cached_pages, "Pages the cached sequence occupies.")
      .def_readonly("prefill_tokens", &KvPlan::prefill_tokens, "len(rebuilt) - reuse_tokens.")
      .def_readonly("shifted_tokens", &KvPlan::shifted_tokens, "Sum of the shifts' lengths.")
      .def_readonly("prefill_tokens_with_shift", &KvPlan::prefill_tokens_with_shift,
                    "prefill_tokens - shifted_tokens.")
      .def_property_readonly(
          "shifts",
          [](const py::object& self) {
            const auto& p = self.cast<const KvPlan&>();
            return RecordsView(p.shifts.data(), p.shifts.size(), 3, self);
          },
          "Verbatim runs to shift: read-only int64[m, 3] (old_begin, new_begin, num_tokens), a view of the plan.")
      .def_property_readonly(
          "prefill_ranges_with_shift",
          [](const py::object& self) {
            const auto& p = self.cast<const KvPlan&>();
            return RecordsView(p.prefill_ranges_with_shift.data(), p.prefill_ranges_with_shift.size(), 2, self);
          },
          "[begin, end) of rebuilt still to compute with the shifts applied: read-only int64[r, 2], a view.")
      .def("__repr__", [](const KvPlan& p) {
        return Repr("KvPlan", {{"common_prefix_tokens", p.common_prefix_tokens},
                               {"reuse_tokens", p.reuse_tokens},
                               {"page_size_tokens", p.page_size_tokens},
                               {"pages_kept", p.pages_kept},
                               {"cached_pages", p.cached_pages},
                               {"prefill_tokens", p.prefill_tokens},
                               {"shifts", Count(p.shifts.size(), "span")},
                               {"shifted_tokens", p.shifted_tokens},
                               {"prefill_tokens_with_shift", p.prefill_tokens_with_shift},
                               {"prefill_ranges_with_shift", Count(p.prefill_ranges_with_shift.size(), "range")}});
      });

  m.def(
      "common_prefix",
      [](const py::array& a, const py::array& b) {
        const auto x = AsSpan<int32_t>(a, "a");
        const auto y = AsSpan<int32_t>(b, "b");
        py::gil_scoped_release nogil;  // reads caller-owned numpy buffers only
        return CommonPrefix(x, y);
      },
      "a"_a, "b"_a, "Length of the longest common prefix of two int32 id arrays.");

  m.def(
      "plan_kv_resync",
      [](const py::array& cached, const py::array& rebuilt, int64_t page_size_tokens, int64_t min_shift_tokens) {
        const auto c = AsSpan<int32_t>(cached, "cached");
        const auto r = AsSpan<int32_t>(rebuilt, "rebuilt");
        py::gil_scoped_release nogil;  // hashing and scans over caller-owned numpy buffers only
        return PlanKvResync(c, r, page_size_tokens, min_shift_tokens);
      },
      "cached"_a, "rebuilt"_a, "page_size_tokens"_a, "min_shift_tokens"_a, "KV re-sync plan -> KvPlan.");
}

}  // namespace ctxfold::bind
