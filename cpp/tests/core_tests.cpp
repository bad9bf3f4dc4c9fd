#include <cstdio>

#include "check.hpp"

int main() {
  for (const auto& c : ctxfold::test::Registry()) {
    const int before = ctxfold::test::Failures();
    c.fn();
    std::printf("%s %s\n", ctxfold::test::Failures() == before ? "ok  " : "FAIL", c.name);
  }
  const int failed = ctxfold::test::Failures();
  std::printf("%zu cases, %d failed checks\n", ctxfold::test::Registry().size(), failed);
  return failed == 0 ? 0 : 1;
}
