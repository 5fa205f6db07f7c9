//! Baichuan2's z-loss on the CPU (f64): `z_loss_rows` finds each target row's max at its first
//! position and skips `-100` rows; the cross entropy plus `z_loss_apply` is differentiated
//! against central finite differences of `Σ_rows (ce + w · max²) · scale` (step 1e-6,
//! relative 1e-6: the max is piecewise linear, and the random logits keep every row's top two
//! values far apart compared with the step).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cpu::{
    IGNORE_INDEX, cross_entropy_forward, cross_entropy_fused, z_loss_apply, z_loss_rows,
};

const ROWS: usize = 13;
const VOCAB: usize = 37;
const WEIGHT: f64 = 0.3;
const SCALE: f64 = 1.0 / 11.0;

fn inputs(seed: u64) -> (Vec<f64>, Vec<i32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let logits = (0..ROWS * VOCAB)
        .map(|_| rng.random_range(-4.0..4.0))
        .collect();
    let targets = (0..ROWS)
        .map(|r| {
            if r % 5 == 2 {
                IGNORE_INDEX
            } else {
                rng.random_range(0..VOCAB as i32)
            }
        })
        .collect();
    (logits, targets)
}

/// `(Σ ce + w · max²) · scale` over the target rows, and the gradient of it.
fn loss_and_grad(logits: &[f64], targets: &[i32]) -> (f64, Vec<f64>) {
    let (mut max, mut arg) = (vec![0.0; ROWS], vec![0; ROWS]);
    z_loss_rows(logits, targets, VOCAB, &mut max, &mut arg).unwrap();
    let mut grad = logits.to_vec();
    let ce = cross_entropy_fused(&mut grad, targets, VOCAB, SCALE).unwrap();
    let z = z_loss_apply(&max, &arg, VOCAB, WEIGHT, SCALE, Some(&mut grad)).unwrap();
    ((ce.loss_sum + z) * SCALE, grad)
}

fn loss_only(logits: &[f64], targets: &[i32]) -> f64 {
    let (mut max, mut arg) = (vec![0.0; ROWS], vec![0; ROWS]);
    z_loss_rows(logits, targets, VOCAB, &mut max, &mut arg).unwrap();
    let ce = cross_entropy_forward(logits, targets, VOCAB).unwrap();
    let z = z_loss_apply::<f64>(&max, &arg, VOCAB, WEIGHT, 0.0, None).unwrap();
    (ce.loss_sum + z) * SCALE
}

#[test]
fn rows_hold_the_first_maximum_of_target_rows() {
    let (mut logits, targets) = inputs(3);
    // A tie in row 0: the first position wins.
    logits[4] = 9.0;
    logits[20] = 9.0;
    let (mut max, mut arg) = (vec![0.0; ROWS], vec![0; ROWS]);
    z_loss_rows(&logits, &targets, VOCAB, &mut max, &mut arg).unwrap();
    assert_eq!((max[0], arg[0]), (9.0, 4));
    for r in 0..ROWS {
        if targets[r] == IGNORE_INDEX {
            assert_eq!(arg[r], -1, "row {r}");
            continue;
        }
        let row = &logits[r * VOCAB..(r + 1) * VOCAB];
        let want = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(max[r], want, "row {r}");
        assert_eq!(row[arg[r] as usize], want, "row {r}");
    }
    let z = z_loss_apply::<f64>(&max, &arg, VOCAB, WEIGHT, 0.0, None).unwrap();
    let want: f64 = (0..ROWS)
        .filter(|&r| targets[r] != IGNORE_INDEX)
        .map(|r| WEIGHT * max[r] * max[r])
        .sum();
    assert!((z - want).abs() <= 1e-12 * want, "{z} vs {want}");
}

#[test]
fn z_loss_gradient_matches_finite_differences() {
    let (logits, targets) = inputs(7);
    let (loss, grad) = loss_and_grad(&logits, &targets);
    assert!((loss - loss_only(&logits, &targets)).abs() <= 1e-12 * loss.abs());
    let h = 1e-6;
    let mut num = vec![0.0; logits.len()];
    for i in 0..logits.len() {
        let mut x = logits.clone();
        x[i] += h;
        let up = loss_only(&x, &targets);
        x[i] -= 2.0 * h;
        num[i] = (up - loss_only(&x, &targets)) / (2.0 * h);
    }
    let diff: f64 = grad.iter().zip(&num).map(|(a, b)| (a - b).powi(2)).sum();
    let norm: f64 = num.iter().map(|b| b * b).sum();
    let err = (diff / norm).sqrt();
    println!("z-loss gradient vs finite differences: rel err {err:.3e}");
    assert!(err < 1e-6, "rel err {err:e}");
    // The z-term is in it: without it the gradient differs.
    let mut plain = logits.clone();
    cross_entropy_fused(&mut plain, &targets, VOCAB, SCALE).unwrap();
    let off: f64 = plain.iter().zip(&grad).map(|(a, b)| (a - b).abs()).sum();
    assert!(off > 1e-2, "{off}");
}
