#include "common.hpp"
#include "ctxfold/ledger.hpp"
#include "ctxfold/tail.hpp"

namespace ctxfold::bind {

void BindTail(py::module_& m) {
  m.attr("RAW_CUT") = kRawCut;
  m.attr("NO_TAIL") = kNoTail;
  m.attr("MAX_BOUNDARY_KINDS") = kMaxBoundaryKinds;

  // Results are read-only records: Python reads them by name, and nothing it does can change what
  // the core decided. `rule` crosses as a plain int; ctxfold.tail.TailRule names the values.
  py::class_<SegmentTail>(m, "SegmentTail", "Tail [start, bottom) over segments, as the core chose it.")
      .def_readonly("start", &SegmentTail::start, "First segment of the tail; == bottom when rule == 0.")
      .def_readonly("num_tokens", &SegmentTail::num_tokens, "Tokens in segments [start, bottom).")
      .def_property_readonly(
          "rule", [](const SegmentTail& t) { return static_cast<int>(t.rule); },
          "The rule that chose start (ctxfold.tail.TailRule value; 0: nothing fits).")
      .def("__repr__", [](const SegmentTail& t) {
        return Repr("SegmentTail", {{"start", t.start}, {"num_tokens", t.num_tokens}, {"rule", t.rule}});
      });

  py::class_<SegmentCut>(m, "SegmentCut", "Newest legal cut: segments [floor, cut) go, [cut, bottom) stay.")
      .def_readonly("found", &SegmentCut::found, "False: dropping everything above the system prefix frees too little.")
      .def_readonly("cut", &SegmentCut::cut, "First kept segment; == bottom when everything above the prefix goes.")
      .def_readonly("freed_tokens", &SegmentCut::freed_tokens, "Tokens in [floor, cut).")
      .def_property_readonly(
          "rule", [](const SegmentCut& c) { return static_cast<int>(c.rule); },
          "Kind of segment at cut (ctxfold.tail.TailRule value; 0 when cut == bottom or not found).")
      .def("__repr__", [](const SegmentCut& c) {
        return Repr("SegmentCut", {{"found", c.found},
                                   {"cut", c.cut},
                                   {"freed_tokens", c.freed_tokens},
                                   {"rule", c.rule}});
      });

  py::class_<TokenTail>(m, "TokenTail", "Tail ids[start:bottom] of a token buffer.")
      .def_readonly("start", &TokenTail::start, "First token of the tail; == bottom when rule == NO_TAIL.")
      .def_readonly("num_tokens", &TokenTail::num_tokens, "bottom - start.")
      .def_readonly("rule", &TokenTail::rule, ">= 0: rank of the boundary kind that chose the cut; RAW_CUT; NO_TAIL.")
      .def("__repr__", [](const TokenTail& t) {
        return Repr("TokenTail", {{"start", t.start}, {"num_tokens", t.num_tokens}, {"rule", t.rule}});
      });

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
        return r;
      },
      "tokens"_a, "flags"_a, "group_starts"_a, "bottom"_a, "budget_tokens"_a, "min_fill"_a,
      "Tail over segments -> SegmentTail. tokens int64[n], flags uint32[n], group_starts int32[n].");

  m.def(
      "select_segment_tail_ledger",
      [](const Ledger& ledger, int64_t bottom, int64_t budget_tokens, double min_fill) {
        // The GIL stays held: the ledger is a mutable Python-owned object, and another thread
        // appending to it could reallocate its arrays under the scan. The scan is microseconds.
        return SelectSegmentTail(ledger, bottom, budget_tokens, min_fill);
      },
      "ledger"_a, "bottom"_a, "budget_tokens"_a, "min_fill"_a, "Tail over a Ledger's own arrays (no copies) -> SegmentTail.");

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
        return r;
      },
      "tokens"_a, "flags"_a, "group_starts"_a, "bottom"_a, "min_free_tokens"_a, "min_fill"_a,
      "Newest legal cut freeing >= min_free_tokens -> SegmentCut.");

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
        return r;
      },
      "ids"_a, "bottom"_a, "floor"_a, "budget_tokens"_a, "boundary_ids"_a, "cut_after"_a, "no_entry"_a, "min_fill"_a,
      "Tail over token ids -> TokenTail (rule = boundary rank, RAW_CUT or NO_TAIL). ids int32[n], "
      "boundary_ids int32[k], cut_after uint8[k], no_entry int64[2*m] flat [begin, end) pairs.");

  m.def("align_down_to_page", &AlignDownToPage, "pos"_a, "page_size_tokens"_a,
        "pos rounded down to a multiple of page_size_tokens.");
}

}  // namespace ctxfold::bind
