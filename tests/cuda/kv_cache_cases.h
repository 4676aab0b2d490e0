// KV-cache cases of the CUDA check build (kv_cache_cases.cu), run by the harness.
#ifndef FA_GPU_KV_CACHE_CASES_H
#define FA_GPU_KV_CACHE_CASES_H

#include <string>

#include "dump.h"

// Runs the KV-cache cases whose name contains `filter` (each through the decode, tiled split and
// dense kernels), printing one line per run and dumping each run's results into `dump` for
// judge.py; adds the runs to *run_count and returns how many failed. Throws CudaFailure
// (device_array.h) on a CUDA error.
int run_kv_cache_cases(const std::string &filter, const Dump &dump, int *run_count);

#endif
