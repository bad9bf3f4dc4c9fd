#include "common.hpp"
#include "ctxfold/tail.hpp"

namespace ctxfold::bind {

void BindTail(py::module_& m) { (void)m; }

}  // namespace ctxfold::bind
