// status.cu: no kernels; turns the status code every launcher returns into text.
//
// Fused: n/a. Layout: n/a. Precision: n/a. Output: n/a (returns static strings owned by the
// CUDA runtime; writes no device memory).
// The launchers return the cudaError_t of cudaGetLastError() as an int; the Rust wrappers call
// these two functions to put "cudaErrorInvalidValue: invalid argument" into their errors.

#include "tilearn_kernels.h"

extern "C" const char* tilearn_status_name(int status) {
    return cudaGetErrorName(static_cast<cudaError_t>(status));
}

extern "C" const char* tilearn_status_string(int status) {
    return cudaGetErrorString(static_cast<cudaError_t>(status));
}
