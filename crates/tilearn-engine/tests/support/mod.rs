//! Helpers shared by the engine's test binaries (each declares `mod support;`, so not every
//! binary uses every helper).
#![allow(dead_code)]

pub mod golden;
#[cfg(feature = "cuda")]
pub mod gpu_parallel;
pub mod packing;
pub mod sft;

use std::io::Write;

use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// A float whose bit pattern can be compared.
pub trait Bits: Copy {
    fn bits(self) -> u64;
}

impl Bits for f32 {
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
}

impl Bits for f64 {
    fn bits(self) -> u64 {
        self.to_bits()
    }
}

/// How many elements of `a` and `b` (same length) differ in their bits.
pub fn differing_bits<T: Bits>(a: &[T], b: &[T]) -> usize {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.bits() != y.bits())
        .count()
}

/// ‖ours − ref‖ / ‖ref‖ in f64; infinite when anything is not finite (so a NaN can never pass a
/// bound).
pub fn rel_err(ours: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(ours.len(), reference.len(), "length mismatch");
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&a, &b) in ours.iter().zip(reference) {
        diff += (a as f64 - b as f64).powi(2);
        norm += (b as f64).powi(2);
    }
    if !diff.is_finite() {
        return f64::INFINITY;
    }
    diff.sqrt() / norm.sqrt().max(f64::MIN_POSITIVE)
}

/// Writes to the process's stderr directly: libtest captures `eprintln!` of passing tests, and
/// the measured errors must be visible in the log.
pub fn report(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Opens GPU 0, or prints why the test is skipped.
#[cfg(feature = "cuda")]
pub fn gpu_or_skip(test: &str) -> Option<tilearn_ops::cuda::GpuDevice> {
    match tilearn_ops::cuda::GpuDevice::new(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            report(&format!("skipped: {test}: {e}"));
            None
        }
    }
}

/// Random ids and labels (`labels == ids` with ~10% ignored), `[batch, seq]`.
pub fn random_batch(
    rng: &mut ChaCha8Rng,
    vocab: usize,
    batch: usize,
    seq: usize,
) -> (Vec<u32>, Vec<i32>) {
    let ids: Vec<u32> = (0..batch * seq)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    let labels = ids
        .iter()
        .map(|&t| {
            if rng.random::<f64>() < 0.1 {
                -100
            } else {
                t as i32
            }
        })
        .collect();
    (ids, labels)
}
