//! ALiBi (attention with linear biases, Press et al. 2021): Bloom's and Baichuan-13B's position
//! encoding. Head `h` adds `slope_h · (j − i)` to the (already scaled) score of query `i` and key
//! `j`, so a key `i − j` tokens back is penalised linearly. Shared by the CPU reference and the
//! CUDA kernels, which all take the slopes as f32 `[q_heads]`.
//!
//! * **Bias.** Bloom adds `slope · key_position` (transformers' `build_alibi_tensor`) and
//!   Baichuan-13B `slope · j` (its `alibi_mask`); per causal row these differ from
//!   `slope · (j − i)` by `slope · i`, a constant that softmax cancels, so the probabilities,
//!   outputs and gradients agree. Only the log-sum-exp differs, which is internal to our
//!   kernels. With packed examples positions restart per example, but a query only sees keys
//!   of its own example, where `pos_j − pos_i = j − i`: the bias needs no positions.
//! * **Slopes.** For `n` heads let `c` be the largest power of two `<= n`. The first `c` heads
//!   get `b^1 .. b^c` with `b = 2^(−8 / c)`; the remaining `n − c` heads (when `n` is not a
//!   power of two) get the odd powers `b'^1, b'^3, ..` of `b' = 2^(−8 / 2c)`, i.e. the slopes
//!   of `2c` heads at odd indices. That is Bloom's `_get_alibi_slopes` and Baichuan's
//!   `_get_interleave` alike. Bloom raises an f32-rounded base to integer powers in f32,
//!   Baichuan computes in f64 and rounds; [`alibi_slopes`] computes in f64 and rounds once,
//!   which agrees with both within an f32 ulp or two.

/// The ALiBi slopes of `heads` attention heads (see the module documentation), in head order;
/// empty for 0 heads.
pub fn alibi_slopes(heads: usize) -> Vec<f32> {
    if heads == 0 {
        return Vec::new();
    }
    // Largest power of two <= heads.
    let c = 1usize << (usize::BITS - 1 - heads.leading_zeros());
    let base = (2.0f64).powf(-8.0 / c as f64);
    let extra_base = (2.0f64).powf(-8.0 / (2 * c) as f64);
    let firsts = (1..=c).map(|p| base.powi(p as i32));
    let extras = (0..heads - c).map(|k| extra_base.powi(2 * k as i32 + 1));
    firsts.chain(extras).map(|s| s as f32).collect()
}

/// The bias ALiBi adds to the scaled score of query `i` and key `j` at `slope`.
pub fn alibi_bias(slope: f32, i: usize, j: usize) -> f64 {
    f64::from(slope) * (j as f64 - i as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn powers_of_two_are_geometric_from_two_to_minus_eight_over_n() {
        assert_eq!(alibi_slopes(1), [2f32.powi(-8)]);
        assert_eq!(
            alibi_slopes(8),
            (1..=8).map(|p| 0.5f32.powi(p)).collect::<Vec<_>>()
        );
        assert_eq!(alibi_slopes(4), [0.25, 0.0625, 0.015625, 0.00390625]);
        assert!(alibi_slopes(0).is_empty());
    }

    #[test]
    fn other_counts_append_the_odd_slopes_of_twice_the_power() {
        // 6 heads: the 4 of c = 4, then slopes 1 and 3 of 8 heads (0.5, 0.125).
        assert_eq!(
            alibi_slopes(6),
            [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
        );
        assert_eq!(alibi_slopes(5)[4], 0.5);
        // 12 heads: the 8 of c = 8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
        let s = alibi_slopes(12);
        assert_eq!(s.len(), 12);
        for (k, want) in [0.5f64, 1.5, 2.5, 3.5].iter().enumerate() {
            assert_eq!(s[8 + k], (2f64).powf(-want) as f32);
        }
    }

    #[test]
    fn bias_is_zero_on_the_diagonal_and_negative_behind() {
        assert_eq!(alibi_bias(0.5, 7, 7), 0.0);
        assert_eq!(alibi_bias(0.5, 7, 3), -2.0);
    }
}
