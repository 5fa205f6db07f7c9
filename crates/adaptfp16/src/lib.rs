//! adaptfp16: the GradScaler and adaptive mixed-precision policies. No CUDA dependency of its own.
