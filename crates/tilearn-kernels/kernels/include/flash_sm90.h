// flash_sm90.h: the entry from flash_attention.cu's launcher into the Hopper (wgmma) kernels of
// flash_attention_sm90.cu. Arguments are validated by the caller (sizes, alignment, dtype).
#ifndef TILEARN_FLASH_SM90_H
#define TILEARN_FLASH_SM90_H

#include <cstddef>

#include "flash_common.cuh"

namespace tilearn::flash {

// True when the Hopper kernels serve the problem (forward and backward) on the current device:
// bf16 / f16, head_dim 64 or 128 (128 unless TILEARN_FLASH_SM90_HD128=0), no key mask or ALiBi,
// a compute-capability-9.0 GPU, and TILEARN_FLASH_SM80 not set.
bool sm90_applies(int dtype, size_t head_dim, bool masked);

// True when, besides, the one-pass backward exists for the problem (head_dim 64): the caller
// then may lend it dq_accum.
bool sm90_one_pass_applies(int dtype, size_t head_dim, bool masked);

// The forward (out, lse) or the backward (dq, dk, dv) of `a` on the Hopper kernels; the
// backward is the one-pass form when `a.dq_accum` is set and sm90_one_pass_applies, else the
// deterministic two-kernel one.
int sm90_run(int dtype, bool backward, size_t head_dim, const Args& a, cudaStream_t stream);

}  // namespace tilearn::flash

#endif  // TILEARN_FLASH_SM90_H
