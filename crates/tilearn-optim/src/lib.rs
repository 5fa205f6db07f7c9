//! tilearn-optim: optimizers over flat parameter buffers, gradient clipping and LR schedules.
