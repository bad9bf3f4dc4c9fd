// A minimal test harness for the core's C++ tests (run by ctest, also under ASan+UBSan).
// Each test file registers cases with CTXFOLD_TEST; core_tests.cpp holds main().
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace ctxfold::test {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& Registry() {
  static std::vector<Case> cases;
  return cases;
}

struct Register {
  Register(const char* name, std::function<void()> fn) { Registry().push_back({name, std::move(fn)}); }
};

inline int& Failures() {
  static int n = 0;
  return n;
}

}  // namespace ctxfold::test

#define CTXFOLD_CAT2(a, b) a##b
#define CTXFOLD_CAT(a, b) CTXFOLD_CAT2(a, b)
#define CTXFOLD_TEST(name)                                                                   \
  static void name();                                                                        \
  static ::ctxfold::test::Register CTXFOLD_CAT(register_, name)(#name, name); \
  static void name()

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);   \
      ++::ctxfold::test::Failures();                                                  \
    }                                                                                 \
  } while (0)

#define CHECK_THROWS(expr, type)                                                     \
  do {                                                                               \
    bool thrown = false;                                                             \
    try {                                                                            \
      (void)(expr);                                                                  \
    } catch (const type&) {                                                          \
      thrown = true;                                                                 \
    }                                                                                \
    if (!thrown) {                                                                   \
      std::fprintf(stderr, "%s:%d: expected %s from %s\n", __FILE__, __LINE__, #type, #expr); \
      ++::ctxfold::test::Failures();                                                 \
    }                                                                                \
  } while (0)
