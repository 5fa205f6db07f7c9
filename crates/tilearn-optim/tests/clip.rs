//! Global gradient norm (deterministic, f64) and clip_grad_norm (torch semantics).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_optim::clip::{NORM_CHUNK, NORM_LANES, clip_coefficient, sum_of_squares};
use tilearn_optim::{clip_grad_norm, global_grad_norm};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

#[test]
fn norm_of_simple_vectors() {
    assert_eq!(global_grad_norm(&[3.0, 4.0]), 5.0);
    assert_eq!(global_grad_norm(&[]), 0.0);
    assert_eq!(global_grad_norm(&[0.0; 100]), 0.0);
    assert_eq!(global_grad_norm(&[-2.0]), 2.0);
}

#[test]
fn norm_is_accumulated_in_f64() {
    // 1e6 copies of 1e-3: an f32 running sum would drift; f64 is exact to ~1e-12 here.
    let g = vec![1e-3f32; 1_000_000];
    let expected = (1_000_000.0 * f64::from(1e-3f32).powi(2)).sqrt();
    let got = global_grad_norm(&g);
    assert!(
        ((got - expected) / expected).abs() < 1e-12,
        "{got} vs {expected}"
    );

    // Elements whose squares overflow f32 still give the right norm.
    let big = [3e20f32, 4e20];
    let n = global_grad_norm(&big);
    assert!((n / 5e20 - 1.0).abs() < 1e-7, "{n}");
}

#[test]
fn norm_is_deterministic_and_follows_the_chunk_contract() {
    let g = random(5 * NORM_CHUNK + 123, 1);
    // The contract: chunks of NORM_CHUNK, each summed in f64 over NORM_LANES interleaved
    // lanes (element i into lane i mod NORM_LANES) added in lane order; chunk sums in order.
    let expected: f64 = g
        .chunks(NORM_CHUNK)
        .map(|c| {
            let mut lanes = [0.0f64; NORM_LANES];
            for (i, &x) in c.iter().enumerate() {
                lanes[i % NORM_LANES] += f64::from(x) * f64::from(x);
            }
            lanes.iter().sum::<f64>()
        })
        .collect::<Vec<_>>()
        .iter()
        .sum();
    let norms: Vec<u64> = [1usize, 2, 3, 8]
        .iter()
        .map(|&threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| global_grad_norm(&g).to_bits())
        })
        .collect();
    assert!(norms.iter().all(|&b| b == norms[0]), "{norms:?}");
    assert_eq!(sum_of_squares(&g).to_bits(), expected.to_bits());
    assert_eq!(f64::from_bits(norms[0]), expected.sqrt());
}

#[test]
fn clips_when_norm_exceeds_max() {
    let mut g = [3.0f32, 4.0];
    let norm = clip_grad_norm(&mut g, 1.0);
    assert_eq!(norm, 5.0, "returns the pre-clip norm");
    // torch: clip_coef = max_norm / (total_norm + 1e-6), applied in f32.
    let coef = (1.0f64 / (5.0 + 1e-6)) as f32;
    assert_eq!(g, [3.0 * coef, 4.0 * coef]);
    let after = global_grad_norm(&g);
    assert!(after < 1.0 && after > 1.0 - 1e-6, "{after}");

    let mut big = random(100_000, 2);
    let before = global_grad_norm(&big);
    assert!(before > 10.0);
    assert_eq!(clip_grad_norm(&mut big, 10.0), before);
    let after = global_grad_norm(&big);
    assert!((after - 10.0).abs() < 1e-4, "{after}");
}

#[test]
fn leaves_gradients_alone_at_or_below_max() {
    let original = random(1000, 3);
    let norm = global_grad_norm(&original);
    for max_norm in [norm, norm * 2.0, f64::INFINITY] {
        let mut g = original.clone();
        assert_eq!(clip_grad_norm(&mut g, max_norm), norm);
        assert_eq!(bits(&g), bits(&original), "max_norm {max_norm}");
    }
}

#[test]
fn non_finite_norm_is_returned_and_gradients_left_unscaled() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut g = vec![1.0f32, 2.0, bad, 3.0];
        let original = bits(&g);
        let norm = clip_grad_norm(&mut g, 1.0);
        assert!(!norm.is_finite(), "{bad}: {norm}");
        if bad.is_nan() {
            assert!(norm.is_nan());
        } else {
            assert_eq!(norm, f64::INFINITY);
        }
        assert_eq!(bits(&g), original);
    }
    assert_eq!(clip_coefficient(f64::NAN, 1.0), None);
    assert_eq!(clip_coefficient(f64::INFINITY, 1.0), None);
}

#[test]
fn degenerate_max_norm() {
    // max_norm 0 zeroes a non-zero gradient (as torch); negative is treated as 0.
    for max_norm in [0.0, -1.0] {
        let mut g = [1.0f32, -2.0];
        assert_eq!(clip_grad_norm(&mut g, max_norm), 5f64.sqrt());
        assert_eq!(g.map(f32::abs), [0.0, 0.0]);
    }
    // A NaN max_norm never clips.
    let mut g = [1.0f32, -2.0];
    clip_grad_norm(&mut g, f64::NAN);
    assert_eq!(g, [1.0, -2.0]);
    // Zero gradients with max_norm 0: norm 0 is not > 0, nothing happens.
    let mut z = [0.0f32; 3];
    assert_eq!(clip_grad_norm(&mut z, 0.0), 0.0);
    assert_eq!(clip_coefficient(2.0, 1.0), Some(1.0 / (2.0 + 1e-6)));
}
