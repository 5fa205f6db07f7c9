//! CPU reference implementations of every op, generic over [`Real`] (f32 in training,
//! f64 in the finite-difference tests).
