// The only PYBIND11_MODULE: registers each area's bindings and nothing else.
#include "common.hpp"

#ifndef CTXFOLD_VERSION
#define CTXFOLD_VERSION "dev"
#endif

PYBIND11_MODULE(_core, m) {
  m.doc() = "ctxfold core: token estimation, the segment ledger, tail selection, KV re-sync plans and a JSON number scan";
  m.attr("__version__") = CTXFOLD_VERSION;
  ctxfold::bind::BindEstimate(m);
  ctxfold::bind::BindLedger(m);
  ctxfold::bind::BindTail(m);
  ctxfold::bind::BindKvPlan(m);
  ctxfold::bind::BindJson(m);
}
