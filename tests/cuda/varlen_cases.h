// Variable-length batch cases of the CUDA check build (varlen_cases.cu), run by the harness.
#ifndef FA_GPU_VARLEN_CASES_H
#define FA_GPU_VARLEN_CASES_H

#include <string>

// Runs the varlen cases whose name contains `filter`, printing one line each; adds the cases run to
// *run_count and returns how many failed. Throws CudaFailure (device_array.h) on a CUDA error.
int run_varlen_cases(const std::string &filter, int *run_count);

#endif
