#include "common.hpp"
#include "ctxfold/kvplan.hpp"

namespace ctxfold::bind {

void BindKvPlan(py::module_& m) {
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
        KvPlan plan;
        {
          py::gil_scoped_release nogil;  // hashing and scans over caller-owned numpy buffers only
          plan = PlanKvResync(c, r, page_size_tokens, min_shift_tokens);
        }
        py::array_t<int64_t> shifts({static_cast<py::ssize_t>(plan.shifts.size()), py::ssize_t{3}});
        int64_t* s = shifts.mutable_data();
        for (const auto& x : plan.shifts) {
          *s++ = x.old_begin;
          *s++ = x.new_begin;
          *s++ = x.num_tokens;
        }
        py::array_t<int64_t> ranges({static_cast<py::ssize_t>(plan.prefill_ranges_with_shift.size()), py::ssize_t{2}});
        int64_t* q = ranges.mutable_data();
        for (const auto& [b, e] : plan.prefill_ranges_with_shift) {
          *q++ = b;
          *q++ = e;
        }
        return py::make_tuple(plan.common_prefix_tokens, plan.reuse_tokens, plan.pages_kept, plan.cached_pages,
                              plan.prefill_tokens, plan.shifted_tokens, plan.prefill_tokens_with_shift, shifts,
                              ranges);
      },
      "cached"_a, "rebuilt"_a, "page_size_tokens"_a, "min_shift_tokens"_a,
      "KV re-sync plan -> (common_prefix, reuse, pages_kept, cached_pages, prefill, shifted, prefill_with_shift, "
      "shifts int64[m, 3] (old_begin, new_begin, num_tokens), prefill_ranges int64[r, 2]).");
}

}  // namespace ctxfold::bind
