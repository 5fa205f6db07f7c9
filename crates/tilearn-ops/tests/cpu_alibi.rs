//! ALiBi on the CPU reference attention, in f64:
//! * the slopes equal those transformers' Bloom computes (`build_alibi_tensor`), values printed
//!   by `scripts/alibi_slopes_reference.py` (its `--check` run on the GPU machine ties them to
//!   transformers), within 1e-6 relative (Bloom raises an f32 base to powers in f32; we round
//!   the exact value once: at most a few f32 ulps apart);
//! * forward and backward match a dense O(T²) attention written from Bloom's definition (bias
//!   `slope · key_position`, positions restarting per packed example), 1e-12 relative: the
//!   probabilities agree because softmax cancels the per-row constant `slope · i`; the lse
//!   differs by exactly that constant, which the test adds back;
//! * the backward matches central finite differences of `L = Σ dout ∘ out` (step 1e-6,
//!   relative 1e-6 on sampled coordinates);
//! * without slopes the `_alibi` functions are the `_masked` ones bit for bit.
//!
//! Head counts 1, 5, 6, 8, 12 (non-powers of two included), odd lengths crossing the 16-row
//! blocks, GQA, packed rows and a sliding window; inputs seeded random, bounded away from 0.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cpu::{
    AttnShape, HostKeyMask, attention_backward_alibi, attention_backward_masked,
    attention_forward_alibi, attention_forward_masked,
};
use tilearn_ops::{KeyMask, alibi_slopes, check_positions, key_start};

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

#[test]
fn slopes_match_transformers_bloom() {
    // scripts/alibi_slopes_reference.py (Bloom's f32 arithmetic).
    let want: [(usize, &[f64]); 6] = [
        (1, &[0.00390625]),
        (5, &[0.25, 0.0625, 0.015625, 0.00390625, 0.5]),
        (6, &[0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]),
        (
            12,
            &[
                0.5,
                0.25,
                0.125,
                0.0625,
                0.03125,
                0.015625,
                0.0078125,
                0.00390625,
                0.7071067690849304,
                0.3535533845424652,
                0.1767766773700714,
                0.0883883386850357,
            ],
        ),
        (
            16,
            &[
                0.7071067690849304,
                0.4999999701976776,
                0.3535533845424652,
                0.2499999850988388,
                0.1767766773700714,
                0.1249999850988388,
                0.0883883386850357,
                0.0624999925494194,
                0.044194165617227554,
                0.031249994412064552,
                0.022097082808613777,
                0.015624997206032276,
                0.011048541404306889,
                0.007812498137354851,
                0.005524270236492157,
                0.0039062488358467817,
            ],
        ),
        (
            40,
            &[
                0.8408964276313782,
                0.7071068286895752,
                0.5946035981178284,
                0.5,
                0.4204482436180115,
                0.3535534143447876,
                0.2973017990589142,
                0.2500000298023224,
                0.21022413671016693,
                0.176776722073555,
                0.1486509144306183,
                0.1250000149011612,
                0.10511206835508347,
                0.0883883684873581,
                0.07432546466588974,
                0.0625000149011612,
                0.05255603790283203,
                0.04419418424367905,
                0.03716273233294487,
                0.0312500074505806,
                0.026278020814061165,
                0.022097093984484673,
                0.018581368029117584,
                0.015625005587935448,
                0.013139011338353157,
                0.011048547923564911,
                0.009290684014558792,
                0.007812502793967724,
                0.006569506134837866,
                0.0055242739617824554,
                0.004645342472940683,
                0.003906251862645149,
                0.9170040488243103,
                0.7711054086685181,
                0.6484197974205017,
                0.5452538728713989,
                0.45850205421447754,
                0.3855527341365814,
                0.32420992851257324,
                0.27262696623802185,
            ],
        ),
    ];
    for (heads, w) in want {
        let got = alibi_slopes(heads);
        assert_eq!(got.len(), heads);
        for (h, (&g, &w)) in got.iter().zip(w).enumerate() {
            let rel = (f64::from(g) - w).abs() / w;
            assert!(rel <= 1e-6, "{heads} heads, head {h}: {g} vs Bloom's {w}");
        }
    }
}

struct Grads {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn run(
    s: AttnShape,
    mask: HostKeyMask<'_>,
    alibi: Option<&[f32]>,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
) -> Grads {
    let mut out = vec![f64::NAN; q.len()];
    let mut lse = vec![f64::NAN; s.batch * s.q_heads * s.seq];
    attention_forward_alibi(s, mask, alibi, q, k, v, &mut out, &mut lse).unwrap();
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
    attention_backward_alibi(
        s, mask, alibi, dout, q, k, v, &out, &lse, &mut dq, &mut dk, &mut dv,
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

/// Bloom's attention from its definition, f64: scores `scale q_i·k_j + slope · pos_j` (pos the
/// key's position in its packed example, as `build_alibi_tensor` counts it from the attention
/// mask's cumulative sum), softmax over the visible keys, then the textbook gradients. `lse`
/// is returned minus `slope · pos_i`, the convention of the op under test.
fn dense_bloom(
    s: AttnShape,
    mask: HostKeyMask<'_>,
    slopes: &[f32],
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
    let pos = |b: usize, i: usize| mask.positions.map_or(i as f64, |p| p[b * t + i] as f64);
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
            let slope = f64::from(slopes[h]);
            for i in 0..t {
                let lo = key_start(i, mask.positions.map(|p| p[b * t + i]), mask.sliding_window);
                let qrow = &q[qi(b, i, h)..qi(b, i, h) + d];
                let sc: Vec<f64> = (lo..=i)
                    .map(|j| {
                        scale * dot(qrow, &k[ki(b, j, kv)..ki(b, j, kv) + d]) + slope * pos(b, j)
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = sc.iter().map(|x| (x - m).exp() / z).collect();
                g.lse[(b * hq + h) * t + i] = m + z.ln() - slope * pos(b, i);
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

/// Restarting positions of `batch` rows from a fixed pattern of example lengths.
fn packed(batch: usize, seq: usize, lens: &[usize]) -> Vec<i32> {
    let mut pos = Vec::new();
    for b in 0..batch {
        let mut t = 0;
        let mut e = b;
        while t < seq {
            let len = lens[e % lens.len()].min(seq - t);
            pos.extend(0..len as i32);
            t += len;
            e += 1;
        }
    }
    check_positions(&pos, batch, seq).unwrap();
    pos
}

fn shape(batch: usize, seq: usize, q_heads: usize, kv_heads: usize, d: usize) -> AttnShape {
    AttnShape {
        batch,
        seq,
        q_heads,
        kv_heads,
        head_dim: d,
    }
}

#[test]
fn alibi_matches_blooms_dense_definition() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (s, packed_lens, window) in [
        (shape(2, 37, 1, 1, 8), None, None),
        (shape(1, 45, 5, 5, 6), None, None),
        (shape(2, 33, 6, 3, 8), Some(&[1usize, 13, 7, 20][..]), None),
        (shape(1, 51, 8, 2, 4), None, Some(9)),
        (shape(2, 29, 12, 4, 4), Some(&[9, 1, 30][..]), Some(6)),
    ] {
        let pos = packed_lens.map(|l| packed(s.batch, s.seq, l));
        let mask: HostKeyMask<'_> = KeyMask {
            positions: pos.as_deref(),
            sliding_window: window,
        };
        let slopes = alibi_slopes(s.q_heads);
        let q = uniform(&mut rng, s.batch * s.seq * s.q_heads * s.head_dim);
        let k = uniform(&mut rng, s.batch * s.seq * s.kv_heads * s.head_dim);
        let v = uniform(&mut rng, k.len());
        let dout = uniform(&mut rng, q.len());
        let got = run(s, mask, Some(&slopes), &q, &k, &v, &dout);
        let want = dense_bloom(s, mask, &slopes, &q, &k, &v, &dout);
        for (what, g, w) in [
            ("out", &got.out, &want.out),
            ("lse", &got.lse, &want.lse),
            ("dq", &got.dq, &want.dq),
            ("dk", &got.dk, &want.dk),
            ("dv", &got.dv, &want.dv),
        ] {
            let e = rel_err(g, w);
            assert!(
                e <= 1e-12,
                "{s:?} packed {packed_lens:?} window {window:?}: {what} {e:e}"
            );
        }
        // The bias changes the result (the test would catch a kernel that ignores it).
        let plain = run(s, mask, None, &q, &k, &v, &dout);
        assert!(
            rel_err(&plain.out, &got.out) > 1e-3,
            "{s:?}: ALiBi had no effect"
        );
    }
}

#[test]
fn alibi_backward_matches_finite_differences() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let s = shape(2, 21, 6, 2, 4);
    let pos = packed(s.batch, s.seq, &[8, 1, 15]);
    let mask: HostKeyMask<'_> = KeyMask::packed(&pos[..]);
    let slopes = alibi_slopes(s.q_heads);
    let q = uniform(&mut rng, s.batch * s.seq * s.q_heads * s.head_dim);
    let k = uniform(&mut rng, s.batch * s.seq * s.kv_heads * s.head_dim);
    let v = uniform(&mut rng, k.len());
    let dout = uniform(&mut rng, q.len());
    let g = run(s, mask, Some(&slopes), &q, &k, &v, &dout);
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        let o = run(s, mask, Some(&slopes), q, k, v, &dout).out;
        o.iter().zip(&dout).map(|(a, b)| a * b).sum()
    };
    let h = 1e-6;
    let (mut num, mut ana) = (Vec::new(), Vec::new());
    for which in 0..3 {
        let n = [q.len(), k.len(), v.len()][which];
        for _ in 0..40 {
            let idx = rng.random_range(0..n);
            let mut x = [q.clone(), k.clone(), v.clone()];
            x[which][idx] += h;
            let up = loss(&x[0], &x[1], &x[2]);
            x[which][idx] -= 2.0 * h;
            let down = loss(&x[0], &x[1], &x[2]);
            num.push((up - down) / (2.0 * h));
            ana.push([&g.dq, &g.dk, &g.dv][which][idx]);
        }
    }
    let e = rel_err(&ana, &num);
    assert!(e <= 1e-6, "ALiBi backward vs finite differences: {e:e}");
}

#[test]
fn no_slopes_is_the_masked_op_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let s = shape(2, 40, 4, 2, 8);
    let pos = packed(s.batch, s.seq, &[17, 5]);
    let mask: HostKeyMask<'_> = KeyMask::packed(&pos[..]).with_sliding_window(Some(11));
    let q = uniform(&mut rng, s.batch * s.seq * s.q_heads * s.head_dim);
    let k = uniform(&mut rng, s.batch * s.seq * s.kv_heads * s.head_dim);
    let v = uniform(&mut rng, k.len());
    let dout = uniform(&mut rng, q.len());
    let got = run(s, mask, None, &q, &k, &v, &dout);
    let mut out = vec![0.0; q.len()];
    let mut lse = vec![0.0; got.lse.len()];
    attention_forward_masked(s, mask, &q, &k, &v, &mut out, &mut lse).unwrap();
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
    attention_backward_masked(
        s, mask, &dout, &q, &k, &v, &out, &lse, &mut dq, &mut dk, &mut dv,
    )
    .unwrap();
    assert_eq!((got.out, got.lse), (out, lse));
    assert_eq!((got.dq, got.dk, got.dv), (dq, dk, dv));
}

#[test]
fn wrong_slope_count_is_a_shape_error() {
    let s = shape(1, 4, 6, 6, 2);
    let x = vec![0.5; 4 * 6 * 2];
    let (mut out, mut lse) = (vec![0.0; x.len()], vec![0.0; 24]);
    let err = attention_forward_alibi(
        s,
        KeyMask::causal(),
        Some(&alibi_slopes(5)),
        &x,
        &x,
        &x,
        &mut out,
        &mut lse,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("alibi slopes"), "{err}");
}

/// Generation with ALiBi: the cached attention of the whole sequence at once (start 0) and of
/// its last rows after a prefill (start > 0) equal the training attention's rows (f32, 1e-5:
/// the same terms summed in another order).
#[test]
fn cached_attention_with_alibi_equals_training_rows() {
    use tilearn_ops::cpu::{CachedAttnShape, cached_attention_alibi};
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let s = shape(1, 23, 6, 2, 8);
    let slopes = alibi_slopes(s.q_heads);
    let f32s = |v: Vec<f64>| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let q = f32s(uniform(&mut rng, s.seq * s.q_heads * s.head_dim));
    let k = f32s(uniform(&mut rng, s.seq * s.kv_heads * s.head_dim));
    let v = f32s(uniform(&mut rng, k.len()));
    let mut want = vec![0.0f32; q.len()];
    let mut lse = vec![0.0f32; s.q_heads * s.seq];
    attention_forward_alibi(
        s,
        KeyMask::causal(),
        Some(&slopes),
        &q,
        &k,
        &v,
        &mut want,
        &mut lse,
    )
    .unwrap();
    let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
    for start in [0, 17] {
        let c = CachedAttnShape {
            n: s.seq - start,
            start,
            q_heads: s.q_heads,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
        };
        let row = s.q_heads * s.head_dim;
        let mut out = vec![f32::NAN; c.q_len()];
        cached_attention_alibi(c, Some(&slopes), &q[start * row..], &k, &v, &mut out).unwrap();
        let got: Vec<f64> = out.iter().map(|&x| x as f64).collect();
        let e = rel_err(&got, &want[start * row..]);
        assert!(e <= 1e-5, "start {start}: cached vs training rows {e:e}");
    }
}
