//! tilearn-affinity: GPU/NUMA/CPU topology and thread pinning. No CUDA dependency of its own.
