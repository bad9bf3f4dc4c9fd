#include "ctxfold/kvplan.hpp"
