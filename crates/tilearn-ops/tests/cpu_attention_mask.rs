//! The CPU reference attention under a key mask, in f64:
//! * packed examples (restarting positions) give, forward and backward, exactly what running
//!   each example alone gives (‖·‖ relative 1e-12: the same terms, other blocking);
//! * a sliding window, alone and with packing, matches a dense O(T²) masked softmax written
//!   from the definition (probabilities, then the textbook gradients), 1e-12;
//! * RoPE at explicit positions equals RoPE of each example alone.
//!
//! Inputs are seeded random values bounded away from zero; lengths are odd and cross the
//! reference's 16-row query blocks; examples of one token are included.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cpu::{
    self, AttnShape, HostKeyMask, RopeScaling, RopeTable, attention_backward,
    attention_backward_masked, attention_forward, attention_forward_masked,
};
use tilearn_ops::{KeyMask, check_positions, key_start};

fn uniform(rng: &mut ChaCha8Rng, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let m = rng.random_range(0.05..1.5);
            if rng.random::<bool>() { m } else { -m }
        })
        .collect()
}

fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Restarting positions of one row from example lengths (which must sum to the row).
fn positions_of(lens: &[usize]) -> Vec<i32> {
    lens.iter().flat_map(|&l| 0..l as i32).collect()
}

struct Grads {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

/// Forward and backward of the reference under `mask`.
fn run(
    s: AttnShape,
    mask: HostKeyMask<'_>,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
) -> Grads {
    let mut out = vec![f64::NAN; q.len()];
    let mut lse = vec![f64::NAN; s.batch * s.q_heads * s.seq];
    attention_forward_masked(s, mask, q, k, v, &mut out, &mut lse).unwrap();
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
    attention_backward_masked(
        s, mask, dout, q, k, v, &out, &lse, &mut dq, &mut dk, &mut dv,
    )
    .unwrap();
    Grads {
        out,
        lse,
        dq,
        dk,
        dv,
    }
}

/// Rows `t0..t0 + len` of a `[seq, heads, d]` tensor (batch 1).
fn rows(x: &[f64], heads: usize, d: usize, t0: usize, len: usize) -> &[f64] {
    &x[t0 * heads * d..(t0 + len) * heads * d]
}

#[test]
fn packed_examples_equal_each_example_alone() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    // One row of 61 tokens: examples crossing the 16-row blocks, and single tokens.
    let lens = [1, 20, 3, 1, 17, 19];
    let seq: usize = lens.iter().sum();
    let (hq, hkv, d) = (4, 2, 8);
    let s = AttnShape {
        batch: 1,
        seq,
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
    };
    let q = uniform(&mut rng, seq * hq * d);
    let k = uniform(&mut rng, seq * hkv * d);
    let v = uniform(&mut rng, seq * hkv * d);
    let dout = uniform(&mut rng, seq * hq * d);
    let pos = positions_of(&lens);
    check_positions(&pos, 1, seq).unwrap();
    let packed = run(s, KeyMask::packed(&pos[..]), &q, &k, &v, &dout);

    let mut t0 = 0;
    for &len in &lens {
        let one = AttnShape { seq: len, ..s };
        let alone = run(
            one,
            KeyMask::causal(),
            rows(&q, hq, d, t0, len),
            rows(&k, hkv, d, t0, len),
            rows(&v, hkv, d, t0, len),
            rows(&dout, hq, d, t0, len),
        );
        for (what, got, want) in [
            ("out", rows(&packed.out, hq, d, t0, len), &alone.out[..]),
            ("dq", rows(&packed.dq, hq, d, t0, len), &alone.dq[..]),
            ("dk", rows(&packed.dk, hkv, d, t0, len), &alone.dk[..]),
            ("dv", rows(&packed.dv, hkv, d, t0, len), &alone.dv[..]),
        ] {
            let err = rel_err(got, want);
            assert!(
                err < 1e-12,
                "example at {t0} (len {len}): {what} rel err {err:e}"
            );
        }
        for h in 0..hq {
            let got = &packed.lse[h * seq + t0..h * seq + t0 + len];
            let want = &alone.lse[h * len..(h + 1) * len];
            assert!(rel_err(got, want) < 1e-12, "lse of example at {t0}");
        }
        t0 += len;
    }
}

#[test]
fn causal_mask_is_the_unmasked_path_bit_for_bit() {
    // Positions 0..T in one example: the same calls as plain causal attention.
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let s = AttnShape {
        batch: 2,
        seq: 37,
        q_heads: 2,
        kv_heads: 1,
        head_dim: 4,
    };
    let q = uniform(&mut rng, 2 * 37 * 2 * 4);
    let k = uniform(&mut rng, 2 * 37 * 4);
    let v = uniform(&mut rng, 2 * 37 * 4);
    let dout = uniform(&mut rng, q.len());
    let pos: Vec<i32> = (0..2).flat_map(|_| 0..37).collect();
    let masked = run(s, KeyMask::packed(&pos[..]), &q, &k, &v, &dout);
    let mut out = vec![0.0; q.len()];
    let mut lse = vec![0.0; 2 * 2 * 37];
    attention_forward(s, &q, &k, &v, &mut out, &mut lse).unwrap();
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
    attention_backward(s, &dout, &q, &k, &v, &out, &lse, &mut dq, &mut dk, &mut dv).unwrap();
    assert_eq!(masked.out, out);
    assert_eq!(masked.lse, lse);
    assert_eq!((masked.dq, masked.dk, masked.dv), (dq, dk, dv));
}

/// Dense masked attention from the definition, f64: `p_ij = softmax_j(s_ij)` over the keys
/// `key_start(i) ..= i`, `out_i = Σ p_ij v_j`; gradients `dv_j = Σ_i p_ij dout_i`,
/// `dp_ij = dout_i · v_j`, `ds_ij = p_ij (dp_ij − Σ_l p_il dp_il)`, `dq_i = scale Σ_j ds_ij k_j`,
/// `dk_j = scale Σ_i ds_ij q_i` (summed over the query heads of a kv head).
fn dense(
    s: AttnShape,
    mask: HostKeyMask<'_>,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
) -> Grads {
    let (t, hq, hkv, d) = (s.seq, s.q_heads, s.kv_heads, s.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let qi = |b: usize, i: usize, h: usize| ((b * t + i) * hq + h) * d;
    let ki = |b: usize, j: usize, g: usize| ((b * t + j) * hkv + g) * d;
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let mut g = Grads {
        out: vec![0.0; q.len()],
        lse: vec![0.0; s.batch * hq * t],
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; k.len()],
    };
    for b in 0..s.batch {
        for h in 0..hq {
            let kv = h / (hq / hkv);
            for i in 0..t {
                let lo = key_start(i, mask.positions.map(|p| p[b * t + i]), mask.sliding_window);
                let qrow = &q[qi(b, i, h)..qi(b, i, h) + d];
                let sc: Vec<f64> = (lo..=i)
                    .map(|j| scale * dot(qrow, &k[ki(b, j, kv)..ki(b, j, kv) + d]))
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = sc.iter().map(|x| (x - m).exp() / z).collect();
                g.lse[(b * hq + h) * t + i] = m + z.ln();
                let drow = &dout[qi(b, i, h)..qi(b, i, h) + d];
                let dp: Vec<f64> = (lo..=i)
                    .map(|j| dot(drow, &v[ki(b, j, kv)..ki(b, j, kv) + d]))
                    .collect();
                let pdp: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (jj, j) in (lo..=i).enumerate() {
                    let ds = p[jj] * (dp[jj] - pdp);
                    for e in 0..d {
                        g.out[qi(b, i, h) + e] += p[jj] * v[ki(b, j, kv) + e];
                        g.dv[ki(b, j, kv) + e] += p[jj] * drow[e];
                        g.dq[qi(b, i, h) + e] += scale * ds * k[ki(b, j, kv) + e];
                        g.dk[ki(b, j, kv) + e] += scale * ds * qrow[e];
                    }
                }
            }
        }
    }
    g
}

#[test]
fn sliding_window_matches_the_dense_definition() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let s = AttnShape {
        batch: 2,
        seq: 45,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    let q = uniform(&mut rng, s.batch * s.seq * s.q_heads * s.head_dim);
    let k = uniform(&mut rng, s.batch * s.seq * s.kv_heads * s.head_dim);
    let v = uniform(&mut rng, k.len());
    let dout = uniform(&mut rng, q.len());
    let pos: Vec<i32> = [positions_of(&[12, 1, 32]), positions_of(&[30, 15])].concat();
    for (label, mask) in [
        ("window 1", KeyMask::causal().with_sliding_window(Some(1))),
        ("window 7", KeyMask::causal().with_sliding_window(Some(7))),
        ("window 20", KeyMask::causal().with_sliding_window(Some(20))),
        (
            "window 100 (longer than seq)",
            KeyMask::causal().with_sliding_window(Some(100)),
        ),
        ("packed", KeyMask::packed(&pos[..])),
        (
            "packed + window 9",
            KeyMask::packed(&pos[..]).with_sliding_window(Some(9)),
        ),
    ] {
        let got = run(s, mask, &q, &k, &v, &dout);
        let want = dense(s, mask, &q, &k, &v, &dout);
        for (what, a, b) in [
            ("out", &got.out, &want.out),
            ("lse", &got.lse, &want.lse),
            ("dq", &got.dq, &want.dq),
            ("dk", &got.dk, &want.dk),
            ("dv", &got.dv, &want.dv),
        ] {
            let err = rel_err(a, b);
            assert!(err < 1e-12, "{label}: {what} rel err {err:e}");
        }
    }
}

#[test]
fn bad_masks_are_refused() {
    let s = AttnShape {
        batch: 1,
        seq: 3,
        q_heads: 1,
        kv_heads: 1,
        head_dim: 2,
    };
    let x = vec![0.5; 6];
    let (mut out, mut lse) = (vec![0.0; 6], vec![0.0; 3]);
    let bad_pos = [0, 2, 3];
    let err = attention_forward_masked(
        s,
        KeyMask::packed(&bad_pos[..]),
        &x,
        &x,
        &x,
        &mut out,
        &mut lse,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("column 1"), "{err}");
    let zero = KeyMask::<&[i32]>::causal().with_sliding_window(Some(0));
    assert!(attention_forward_masked(s, zero, &x, &x, &x, &mut out, &mut lse).is_err());
    let short = [0, 1];
    assert!(
        attention_forward_masked(
            s,
            KeyMask::packed(&short[..]),
            &x,
            &x,
            &x,
            &mut out,
            &mut lse
        )
        .is_err()
    );
}

#[test]
fn rope_at_restarting_positions_equals_each_example_alone() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (heads, d) = (3, 8);
    let lens = [5, 1, 9];
    let seq: usize = lens.iter().sum();
    let table = RopeTable::new(d, 10000.0, &RopeScaling::None, seq, seq);
    let x = uniform(&mut rng, seq * heads * d);
    let pos = positions_of(&lens);
    let mut packed = x.clone();
    cpu::rope_forward_at(&mut packed, 1, seq, heads, d, &table, Some(&pos)).unwrap();
    let mut t0 = 0;
    for &len in &lens {
        let mut alone = rows(&x, heads, d, t0, len).to_vec();
        cpu::rope_forward(&mut alone, 1, len, heads, d, &table).unwrap();
        assert_eq!(rows(&packed, heads, d, t0, len), &alone[..]);
        t0 += len;
    }
    // The backward undoes the forward.
    cpu::rope_backward_at(&mut packed, 1, seq, heads, d, &table, Some(&pos)).unwrap();
    assert!(rel_err(&packed, &x) < 1e-14);
    // A position past the table is an error, not a panic.
    let far = vec![seq as i32; seq];
    let mut y = x.clone();
    assert!(cpu::rope_forward_at(&mut y, 1, seq, heads, d, &table, Some(&far)).is_err());
}
