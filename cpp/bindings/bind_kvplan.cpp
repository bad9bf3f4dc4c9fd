#include "common.hpp"
#include "ctxfold/kvplan.hpp"

namespace ctxfold::bind {

void BindKvPlan(py::module_& m) { (void)m; }

}  // namespace ctxfold::bind
