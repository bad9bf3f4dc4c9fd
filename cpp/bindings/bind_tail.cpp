#include "common.hpp"
#include "ctxfold/ledger.hpp"
#include "ctxfold/tail.hpp"

namespace ctxfold::bind {

namespace {
py::tuple ToTuple(const SegmentTail& t) { return py::make_tuple(t.start, t.num_tokens, static_cast<int>(t.rule)); }
}  // namespace

void BindTail(py::module_& m) {
  m.attr("RAW_CUT") = kRawCut;
  m.attr("NO_TAIL") = kNoTail;
  m.attr("MAX_BOUNDARY_KINDS") = kMaxBoundaryKinds;

  m.def(
      "select_segment_tail",
      [](const py::array& tokens, const py::array& flags, const py::array& group_starts, int64_t bottom,
         int64_t budget_tokens, double min_fill) {
        const auto t = AsSpan<int64_t>(tokens, "tokens");
        const auto f = AsSpan<uint32_t>(flags, "flags");
        const auto g = AsSpan<int32_t>(group_starts, "group_starts");
        SegmentTail r;
        {
          py::gil_scoped_release nogil;  // the scan reads caller-owned numpy buffers only
          r = SelectSegmentTail(t, f, g, bottom, budget_tokens, min_fill);
        }
        return ToTuple(r);
      },
      "tokens"_a, "flags"_a, "group_starts"_a, "bottom"_a, "budget_tokens"_a, "min_fill"_a,
      "Tail over segments -> (start, num_tokens, rule). tokens int64[n], flags uint32[n], group_starts int32[n].");

  m.def(
      "select_segment_tail_ledger",
      [](const Ledger& ledger, int64_t bottom, int64_t budget_tokens, double min_fill) {
        // The GIL stays held: the ledger is a mutable Python-owned object, and another thread
        // appending to it could reallocate its arrays under the scan. The scan is microseconds.
        return ToTuple(SelectSegmentTail(ledger, bottom, budget_tokens, min_fill));
      },
      "ledger"_a, "bottom"_a, "budget_tokens"_a, "min_fill"_a,
      "Tail over a Ledger's own arrays (no copies) -> (start, num_tokens, rule).");

  m.def(
      "select_segment_cut",
      [](const py::array& tokens, const py::array& flags, const py::array& group_starts, int64_t bottom,
         int64_t min_free_tokens, double min_fill) {
        const auto t = AsSpan<int64_t>(tokens, "tokens");
        const auto f = AsSpan<uint32_t>(flags, "flags");
        const auto g = AsSpan<int32_t>(group_starts, "group_starts");
        SegmentCut r;
        {
          py::gil_scoped_release nogil;  // the scan reads caller-owned numpy buffers only
          r = SelectSegmentCut(t, f, g, bottom, min_free_tokens, min_fill);
        }
        return py::make_tuple(r.found, r.cut, r.freed_tokens, static_cast<int>(r.rule));
      },
      "tokens"_a, "flags"_a, "group_starts"_a, "bottom"_a, "min_free_tokens"_a, "min_fill"_a,
      "Newest legal cut freeing >= min_free_tokens -> (found, cut, freed_tokens, rule).");

  m.def(
      "select_token_tail",
      [](const py::array& ids, int64_t bottom, int64_t floor, int64_t budget_tokens, const py::array& boundary_ids,
         const py::array& cut_after, const py::array& no_entry, double min_fill) {
        const auto v = AsSpan<int32_t>(ids, "ids");
        const auto b = AsSpan<int32_t>(boundary_ids, "boundary_ids");
        const auto a = AsSpan<uint8_t>(cut_after, "cut_after");
        const auto s = AsSpan<int64_t>(no_entry, "no_entry");
        TokenTail r;
        {
          py::gil_scoped_release nogil;  // the scan reads caller-owned numpy buffers only
          r = SelectTokenTail(v, bottom, floor, budget_tokens, b, a, s, min_fill);
        }
        return py::make_tuple(r.start, r.num_tokens, r.rule);
      },
      "ids"_a, "bottom"_a, "floor"_a, "budget_tokens"_a, "boundary_ids"_a, "cut_after"_a, "no_entry"_a, "min_fill"_a,
      "Tail over token ids -> (start, num_tokens, rule): rule = boundary rank, RAW_CUT or NO_TAIL. ids int32[n], "
      "boundary_ids int32[k], cut_after uint8[k], no_entry int64[2*m] flat [begin, end) pairs.");

  m.def("align_down_to_page", &AlignDownToPage, "pos"_a, "page_size_tokens"_a,
        "pos rounded down to a multiple of page_size_tokens.");
}

}  // namespace ctxfold::bind
