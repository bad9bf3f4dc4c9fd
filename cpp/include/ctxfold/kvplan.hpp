// KV re-sync plan between a cached token sequence and the rebuilt one.
#pragma once
