#include "ctxfold/tail.hpp"
