//! The bf16 working copy of fp32 master weights, as the fused CUDA optimizers write it:
//! round to nearest even, NaN kept quiet. The host path of the same step (the lean mode's host
//! AdamW, [`Adam::step_fused`](crate::Adam::step_fused)) uses these, so both write the same bits.

use rayon::prelude::*;

/// `half::bf16::from_f32(x).to_bits()` without branches, so that a loop of it vectorises:
/// round to nearest even by adding 0x7fff plus the kept part's lowest bit, and a NaN kept quiet
/// with its sign and top payload bits, exactly as `half` does (tested against it).
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x0040;
    let is_nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

/// `out[i] = bf16_bits(src[i])`, in parallel; the slices have equal lengths.
pub fn cast_to_bf16_bits(src: &[f32], out: &mut [u16]) {
    const CHUNK: usize = 1 << 16;
    out.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(o, s)| copy_slice(s, o));
}

/// `out[i] = bf16_bits(src[i])` on one thread.
#[inline]
pub(crate) fn copy_slice(src: &[f32], out: &mut [u16]) {
    for (o, &x) in out.iter_mut().zip(src) {
        *o = bf16_bits(x);
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    #[test]
    fn the_branchless_rounding_is_halfs() {
        // Every 65 537th bit pattern (all exponents and signs, assorted mantissas), the
        // patterns around each rounding tie and each exponent boundary, and the specials.
        let strided = (0..=u32::MAX / 65_537).map(|i| i * 65_537);
        let ties = (0..=0xffffu32).flat_map(|hi| {
            let base = hi << 16;
            [
                base | 0x7fff,
                base | 0x8000,
                base | 0x8001,
                base | 0xffff,
                base,
            ]
        });
        let specials = [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            -0.0,
        ]
        .map(f32::to_bits);
        for bits in strided.chain(ties).chain(specials) {
            let x = f32::from_bits(bits);
            assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "{bits:#010x}");
        }
    }

    #[test]
    fn the_parallel_cast_covers_every_element() {
        let src: Vec<f32> = (0..200_003).map(|i| (i as f32).sin() * 1e3).collect();
        let mut out = vec![0u16; src.len()];
        cast_to_bf16_bits(&src, &mut out);
        for (&x, &o) in src.iter().zip(&out) {
            assert_eq!(o, bf16::from_f32(x).to_bits());
        }
    }
}
