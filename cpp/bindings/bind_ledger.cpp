#include "common.hpp"
#include "ctxfold/ledger.hpp"

namespace ctxfold::bind {

void BindLedger(py::module_& m) {
  py::class_<Ledger>(m, "Ledger", "Segment table of one conversation; not thread-safe (one owner per conversation).")
      .def(py::init<>())
      .def("append", &Ledger::Append, "content_key"_a, "num_tokens"_a, "flags"_a, "group_start"_a)
      .def(
          "append_batch",
          [](Ledger& self, const py::array& keys, const py::array& num_tokens, const py::array& flags,
             const py::array& group_start) {
            self.AppendBatch(AsSpan<uint64_t>(keys, "keys"), AsSpan<int64_t>(num_tokens, "num_tokens"),
                             AsSpan<uint32_t>(flags, "flags"), AsSpan<int64_t>(group_start, "group_start"));
          },
          "keys"_a, "num_tokens"_a, "flags"_a, "group_start"_a,
          "Append many segments: uint64 keys, int64 counts, uint32 flags, int64 group starts, one length.")
      .def("truncate", &Ledger::Truncate, "num_segments"_a)
      .def("replace", &Ledger::Replace, "index"_a, "content_key"_a, "num_tokens"_a, "flags"_a)
      .def("cached_count", &Ledger::CachedCount, "content_key"_a)
      .def("remember_count", &Ledger::RememberCount, "content_key"_a, "num_tokens"_a)
      .def("clear", &Ledger::Clear)
      .def("__len__", &Ledger::size)
      .def_property_readonly("total_tokens", &Ledger::total_tokens)
      .def_property_readonly("num_user_turns", &Ledger::num_user_turns)
      .def_property_readonly("cache_size", &Ledger::cache_size)
      // One segment's fields in O(1); IndexError naming the index and the length. For reading a
      // few values, where the column accessors below would copy a whole column.
      .def("num_tokens_at", &Ledger::NumTokensAt, "index"_a, "Token count of segment `index`.")
      .def("flags_at", &Ledger::FlagsAt, "index"_a, "SegmentFlag bits of segment `index`.")
      .def("user_turn_at", &Ledger::UserTurnAt, "index"_a, "Real user turns up to and including segment `index`.")
      .def("group_start_at", &Ledger::GroupStartAt, "index"_a, "First segment of the atomic group of `index`.")
      .def("key_at", &Ledger::KeyAt, "index"_a, "Content key of segment `index`.")
      // Copies, not views: a view into a vector would dangle after the next append.
      .def("tokens", [](const Ledger& self) { return ToArray(self.tokens()); })
      .def("flags", [](const Ledger& self) { return ToArray(self.flags()); })
      .def("user_turns", [](const Ledger& self) { return ToArray(self.user_turns()); })
      .def("group_starts", [](const Ledger& self) { return ToArray(self.group_starts()); })
      .def("keys", [](const Ledger& self) { return ToArray(self.keys()); });
}

}  // namespace ctxfold::bind
