//! Every CPU op answers a wrong length with `OpsError::ShapeMismatch` naming the op and the
//! argument, with the expected and actual element counts (the variant the CUDA wrappers return),
//! and leaves its outputs untouched: one table with a row per (op, argument).
//!
//! Each row calls the op with the argument one element too long (or the shape it is checked
//! against changed); the same helper with the right lengths must succeed, so a row cannot pass
//! because the helper itself fails.

use tilearn_ops::OpsError;
use tilearn_ops::cpu::*;

/// What an output holds before the call; an op that fails must leave it there.
const SENTINEL: f64 = -7.25;

/// Linear: rows, in_features, out_features.
const R: usize = 3;
const I: usize = 4;
const O: usize = 5;
/// Elementwise ops: length of every operand.
const N: usize = 10;
/// Embedding: vocabulary, width, number of ids.
const VOCAB: usize = 4;
const DIM: usize = 3;
const IDS: [u32; 2] = [3, 0];
/// RoPE and attention: batch, sequence, heads, head dim.
const B: usize = 1;
const T: usize = 3;
const H: usize = 2;
const D: usize = 4;

/// An op's result and whether every output still holds [`SENTINEL`].
type Outcome = (tilearn_ops::Result<()>, bool);

fn input(n: usize) -> Vec<f64> {
    (0..n).map(|i| 0.25 + 0.125 * (i % 5) as f64).collect()
}

fn output(n: usize) -> Vec<f64> {
    vec![SENTINEL; n]
}

fn untouched(outputs: &[&[f64]]) -> bool {
    outputs
        .iter()
        .all(|o| o.iter().all(|v| v.to_bits() == SENTINEL.to_bits()))
}

fn linear_fwd([x, w, bias, out]: [usize; 4]) -> Outcome {
    let b = input(bias);
    let mut o = output(out);
    let r = linear_forward(&input(x), &input(w), Some(&b), R, I, O, &mut o);
    (r, untouched(&[&o]))
}

fn linear_bwd([dout, x, w, dx, dw, db]: [usize; 6]) -> Outcome {
    let (mut dxv, mut dwv, mut dbv) = (output(dx), output(dw), output(db));
    let r = linear_backward(
        &input(dout),
        &input(x),
        &input(w),
        R,
        I,
        O,
        Some(&mut dxv),
        &mut dwv,
        Some(&mut dbv),
    );
    (r, untouched(&[&dxv, &dwv, &dbv]))
}

fn rmsnorm_fwd(dim: usize, [x, weight, out, rstd]: [usize; 4]) -> Outcome {
    let (mut o, mut rs) = (output(out), output(rstd));
    let r = rmsnorm_forward(&input(x), &input(weight), dim, 1e-5, &mut o, &mut rs);
    (r, untouched(&[&o, &rs]))
}

fn rmsnorm_bwd(dim: usize, [dout, x, weight, rstd, dx, dweight]: [usize; 6]) -> Outcome {
    let (mut dxv, mut dw) = (output(dx), output(dweight));
    let r = rmsnorm_backward(
        &input(dout),
        &input(x),
        &input(weight),
        &input(rstd),
        dim,
        &mut dxv,
        &mut dw,
    );
    (r, untouched(&[&dxv, &dw]))
}

fn layernorm_fwd([x, weight, bias, out, mean, rstd]: [usize; 6]) -> Outcome {
    let (mut o, mut m, mut rs) = (output(out), output(mean), output(rstd));
    let (w, b) = (input(weight), input(bias));
    let r = layernorm_forward(&input(x), &w, &b, I, 1e-5, &mut o, &mut m, &mut rs);
    (r, untouched(&[&o, &m, &rs]))
}

fn layernorm_bwd([dout, x, weight, mean, rstd, dx, dw, db]: [usize; 8]) -> Outcome {
    let (mut dxv, mut dwv, mut dbv) = (output(dx), output(dw), output(db));
    let r = layernorm_backward(
        &input(dout),
        &input(x),
        &input(weight),
        &input(mean),
        &input(rstd),
        I,
        &mut dxv,
        &mut dwv,
        &mut dbv,
    );
    (r, untouched(&[&dxv, &dwv, &dbv]))
}

fn gelu_fwd([x, out]: [usize; 2]) -> Outcome {
    let mut o = output(out);
    let r = gelu_tanh_forward(&input(x), &mut o);
    (r, untouched(&[&o]))
}

fn gelu_bwd([dout, x, dx]: [usize; 3]) -> Outcome {
    let mut d = output(dx);
    let r = gelu_tanh_backward(&input(dout), &input(x), &mut d);
    (r, untouched(&[&d]))
}

fn swiglu_fwd([gate, up, out]: [usize; 3]) -> Outcome {
    let mut o = output(out);
    let r = swiglu_forward(&input(gate), &input(up), &mut o);
    (r, untouched(&[&o]))
}

fn swiglu_bwd([dout, gate, up, dgate, dup]: [usize; 5]) -> Outcome {
    let (mut dg, mut du) = (output(dgate), output(dup));
    let r = swiglu_backward(&input(dout), &input(gate), &input(up), &mut dg, &mut du);
    (r, untouched(&[&dg, &du]))
}

fn add([acc, x]: [usize; 2]) -> Outcome {
    let mut a = output(acc);
    let r = add_inplace(&mut a, &input(x));
    (r, untouched(&[&a]))
}

fn embedding_fwd(dim: usize, [table, out]: [usize; 2]) -> Outcome {
    let mut o = output(out);
    let r = embedding_forward(&IDS, &input(table), dim, &mut o);
    (r, untouched(&[&o]))
}

fn embedding_bwd(dim: usize, [dout, dtable]: [usize; 2]) -> Outcome {
    let mut dt = output(dtable);
    let r = embedding_backward(&IDS, &input(dout), dim, &mut dt);
    (r, untouched(&[&dt]))
}

/// RoPE over `[B, T, H, D]` (`x` elements) with a table for `head_dim` and `positions`, whose
/// `cos` is cut to `cos_len` when given.
fn rope(
    backward: bool,
    x: usize,
    head_dim: usize,
    positions: usize,
    cos_len: Option<usize>,
) -> Outcome {
    let mut table = RopeTable::new(head_dim, 10_000.0, &RopeScaling::None, positions, positions);
    if let Some(len) = cos_len {
        table.cos.truncate(len);
    }
    let mut xv = output(x);
    let r = if backward {
        rope_backward(&mut xv, B, T, H, D, &table)
    } else {
        rope_forward(&mut xv, B, T, H, D, &table)
    };
    (r, untouched(&[&xv]))
}

fn shape(q_heads: usize, kv_heads: usize, head_dim: usize) -> AttnShape {
    AttnShape {
        batch: B,
        seq: T,
        q_heads,
        kv_heads,
        head_dim,
    }
}

/// Attention with `H` query heads sharing one kv head.
fn gqa() -> AttnShape {
    shape(H, 1, D)
}

fn attention_fwd(s: AttnShape, [q, k, v, out, lse]: [usize; 5]) -> Outcome {
    let (mut o, mut l) = (output(out), output(lse));
    let r = attention_forward(s, &input(q), &input(k), &input(v), &mut o, &mut l);
    (r, untouched(&[&o, &l]))
}

fn attention_bwd([dout, q, k, v, out, lse, dq, dk, dv]: [usize; 9]) -> Outcome {
    let (mut dqv, mut dkv, mut dvv) = (output(dq), output(dk), output(dv));
    let r = attention_backward(
        gqa(),
        &input(dout),
        &input(q),
        &input(k),
        &input(v),
        &input(out),
        &input(lse),
        &mut dqv,
        &mut dkv,
        &mut dvv,
    );
    (r, untouched(&[&dqv, &dkv, &dvv]))
}

fn cross_entropy(fused: bool, logits: usize) -> Outcome {
    let targets = [1, -100, 2];
    let mut l = output(logits);
    let r = if fused {
        cross_entropy_fused(&mut l, &targets, VOCAB, 1.0)
    } else {
        cross_entropy_forward(&l, &targets, VOCAB)
    };
    (r.map(|_| ()), untouched(&[&l]))
}

#[test]
fn bad_lengths_are_shape_errors_that_leave_outputs_untouched() {
    // Right lengths: the helpers work, so every failure below is the one length changed.
    let (q, kv, lse) = (B * T * H * D, B * T * D, B * H * T);
    let good: Vec<(&str, Outcome)> = vec![
        ("linear_forward", linear_fwd([R * I, O * I, O, R * O])),
        (
            "linear_backward",
            linear_bwd([R * O, R * I, O * I, R * I, O * I, O]),
        ),
        ("rmsnorm_forward", rmsnorm_fwd(I, [R * I, I, R * I, R])),
        (
            "rmsnorm_backward",
            rmsnorm_bwd(I, [R * I, R * I, I, R, R * I, I]),
        ),
        ("swiglu_forward", swiglu_fwd([N; 3])),
        ("swiglu_backward", swiglu_bwd([N; 5])),
        (
            "layernorm_forward",
            layernorm_fwd([R * I, I, I, R * I, R, R]),
        ),
        (
            "layernorm_backward",
            layernorm_bwd([R * I, R * I, I, R, R, R * I, I, I]),
        ),
        ("gelu_tanh_forward", gelu_fwd([N; 2])),
        ("gelu_tanh_backward", gelu_bwd([N; 3])),
        ("add_inplace", add([N; 2])),
        (
            "embedding_forward",
            embedding_fwd(DIM, [VOCAB * DIM, 2 * DIM]),
        ),
        (
            "embedding_backward",
            embedding_bwd(DIM, [2 * DIM, VOCAB * DIM]),
        ),
        ("rope_forward", rope(false, q, D, T, None)),
        ("rope_backward", rope(true, q, D, T, None)),
        (
            "attention_forward",
            attention_fwd(gqa(), [q, kv, kv, q, lse]),
        ),
        (
            "attention_backward",
            attention_bwd([q, q, kv, kv, q, lse, q, kv, kv]),
        ),
        ("cross_entropy_forward", cross_entropy(false, 3 * VOCAB)),
        ("cross_entropy_fused", cross_entropy(true, 3 * VOCAB)),
    ];
    for (name, (result, _)) in good {
        assert!(result.is_ok(), "{name} with the right lengths: {result:?}");
    }

    // (the op and argument the error must name, expected, actual, the call)
    let cases: Vec<(&str, usize, usize, Outcome)> = vec![
        (
            "linear_forward (x)",
            R * I,
            R * I + 1,
            linear_fwd([R * I + 1, O * I, O, R * O]),
        ),
        (
            "linear_forward (w)",
            O * I,
            O * I + 1,
            linear_fwd([R * I, O * I + 1, O, R * O]),
        ),
        (
            "linear_forward (out)",
            R * O,
            R * O + 1,
            linear_fwd([R * I, O * I, O, R * O + 1]),
        ),
        (
            "linear_forward (bias)",
            O,
            O + 1,
            linear_fwd([R * I, O * I, O + 1, R * O]),
        ),
        (
            "linear_backward (dout)",
            R * O,
            R * O + 1,
            linear_bwd([R * O + 1, R * I, O * I, R * I, O * I, O]),
        ),
        (
            "linear_backward (x)",
            R * I,
            R * I + 1,
            linear_bwd([R * O, R * I + 1, O * I, R * I, O * I, O]),
        ),
        (
            "linear_backward (w)",
            O * I,
            O * I + 1,
            linear_bwd([R * O, R * I, O * I + 1, R * I, O * I, O]),
        ),
        (
            "linear_backward (dx)",
            R * I,
            R * I + 1,
            linear_bwd([R * O, R * I, O * I, R * I + 1, O * I, O]),
        ),
        (
            "linear_backward (dw)",
            O * I,
            O * I + 1,
            linear_bwd([R * O, R * I, O * I, R * I, O * I + 1, O]),
        ),
        (
            "linear_backward (db)",
            O,
            O + 1,
            linear_bwd([R * O, R * I, O * I, R * I, O * I, O + 1]),
        ),
        // x of 13 is not whole rows of 4: the next whole number of rows is 16.
        (
            "rmsnorm_forward (x)",
            16,
            13,
            rmsnorm_fwd(I, [13, I, 13, R]),
        ),
        (
            "rmsnorm_forward (x)",
            1,
            0,
            rmsnorm_fwd(0, [R * I, I, R * I, R]),
        ),
        (
            "rmsnorm_forward (weight)",
            I,
            I + 1,
            rmsnorm_fwd(I, [R * I, I + 1, R * I, R]),
        ),
        (
            "rmsnorm_forward (out)",
            R * I,
            R * I + 1,
            rmsnorm_fwd(I, [R * I, I, R * I + 1, R]),
        ),
        (
            "rmsnorm_forward (rstd)",
            R,
            R + 1,
            rmsnorm_fwd(I, [R * I, I, R * I, R + 1]),
        ),
        (
            "rmsnorm_backward (x)",
            16,
            13,
            rmsnorm_bwd(I, [13, 13, I, R, 13, I]),
        ),
        (
            "rmsnorm_backward (weight)",
            I,
            I + 1,
            rmsnorm_bwd(I, [R * I, R * I, I + 1, R, R * I, I]),
        ),
        (
            "rmsnorm_backward (dweight)",
            I,
            I + 1,
            rmsnorm_bwd(I, [R * I, R * I, I, R, R * I, I + 1]),
        ),
        (
            "rmsnorm_backward (dout)",
            R * I,
            R * I + 1,
            rmsnorm_bwd(I, [R * I + 1, R * I, I, R, R * I, I]),
        ),
        (
            "rmsnorm_backward (dx)",
            R * I,
            R * I + 1,
            rmsnorm_bwd(I, [R * I, R * I, I, R, R * I + 1, I]),
        ),
        (
            "rmsnorm_backward (rstd)",
            R,
            R + 1,
            rmsnorm_bwd(I, [R * I, R * I, I, R + 1, R * I, I]),
        ),
        ("swiglu_forward (up)", N, N + 1, swiglu_fwd([N, N + 1, N])),
        ("swiglu_forward (out)", N, N + 1, swiglu_fwd([N, N, N + 1])),
        (
            "swiglu_backward (gate)",
            N,
            N + 1,
            swiglu_bwd([N, N + 1, N, N, N]),
        ),
        (
            "swiglu_backward (up)",
            N,
            N + 1,
            swiglu_bwd([N, N, N + 1, N, N]),
        ),
        (
            "swiglu_backward (dgate)",
            N,
            N + 1,
            swiglu_bwd([N, N, N, N + 1, N]),
        ),
        (
            "swiglu_backward (dup)",
            N,
            N + 1,
            swiglu_bwd([N, N, N, N, N + 1]),
        ),
        ("add_inplace (x)", N, N + 1, add([N, N + 1])),
        // A table of 13 is not whole rows of 3: the next whole number of rows is 15.
        (
            "embedding_forward (table)",
            15,
            13,
            embedding_fwd(DIM, [13, 2 * DIM]),
        ),
        (
            "embedding_forward (table)",
            1,
            0,
            embedding_fwd(0, [VOCAB * DIM, 0]),
        ),
        (
            "embedding_forward (out)",
            2 * DIM,
            2 * DIM + 1,
            embedding_fwd(DIM, [VOCAB * DIM, 2 * DIM + 1]),
        ),
        (
            "embedding_backward (dtable)",
            15,
            13,
            embedding_bwd(DIM, [2 * DIM, 13]),
        ),
        (
            "embedding_backward (dtable)",
            1,
            0,
            embedding_bwd(0, [0, VOCAB * DIM]),
        ),
        (
            "embedding_backward (dout)",
            2 * DIM,
            2 * DIM + 1,
            embedding_bwd(DIM, [2 * DIM + 1, VOCAB * DIM]),
        ),
        (
            "rope (x = batch x seq x heads x head_dim)",
            q,
            q + 1,
            rope(false, q + 1, D, T, None),
        ),
        (
            "rope (x = batch x seq x heads x head_dim)",
            q,
            q + 1,
            rope(true, q + 1, D, T, None),
        ),
        (
            "rope (head_dim = 2 x table half_dim)",
            D + 2,
            D,
            rope(false, q, D + 2, T, None),
        ),
        (
            "rope (table positions: at least seq; build the RopeTable for the longest sequence)",
            T,
            T - 1,
            rope(true, q, D, T - 1, None),
        ),
        (
            "rope (table cos = seq_len x half_dim)",
            T * D / 2,
            T * D / 2 - 1,
            rope(false, q, D, T, Some(T * D / 2 - 1)),
        ),
        (
            "attention_forward (q)",
            q,
            q + 1,
            attention_fwd(gqa(), [q + 1, kv, kv, q, lse]),
        ),
        (
            "attention_forward (k)",
            kv,
            kv + 1,
            attention_fwd(gqa(), [q, kv + 1, kv, q, lse]),
        ),
        (
            "attention_forward (v)",
            kv,
            kv + 1,
            attention_fwd(gqa(), [q, kv, kv + 1, q, lse]),
        ),
        (
            "attention_forward (out)",
            q,
            q + 1,
            attention_fwd(gqa(), [q, kv, kv, q + 1, lse]),
        ),
        (
            "attention_forward (lse)",
            lse,
            lse + 1,
            attention_fwd(gqa(), [q, kv, kv, q, lse + 1]),
        ),
        (
            "attention (head_dim)",
            1,
            0,
            attention_fwd(shape(H, 1, 0), [0, 0, 0, 0, lse]),
        ),
        (
            "attention (kv_heads)",
            1,
            0,
            attention_fwd(shape(H, 0, D), [q, 0, 0, q, lse]),
        ),
        (
            "attention (q_heads: a multiple of kv_heads)",
            4,
            3,
            attention_fwd(
                shape(3, 2, D),
                [3 * T * D, 2 * T * D, 2 * T * D, 3 * T * D, 3 * T],
            ),
        ),
        (
            "attention_backward (dout)",
            q,
            q + 1,
            attention_bwd([q + 1, q, kv, kv, q, lse, q, kv, kv]),
        ),
        (
            "attention_backward (q)",
            q,
            q + 1,
            attention_bwd([q, q + 1, kv, kv, q, lse, q, kv, kv]),
        ),
        (
            "attention_backward (k)",
            kv,
            kv + 1,
            attention_bwd([q, q, kv + 1, kv, q, lse, q, kv, kv]),
        ),
        (
            "attention_backward (v)",
            kv,
            kv + 1,
            attention_bwd([q, q, kv, kv + 1, q, lse, q, kv, kv]),
        ),
        (
            "attention_backward (out)",
            q,
            q + 1,
            attention_bwd([q, q, kv, kv, q + 1, lse, q, kv, kv]),
        ),
        (
            "attention_backward (lse)",
            lse,
            lse + 1,
            attention_bwd([q, q, kv, kv, q, lse + 1, q, kv, kv]),
        ),
        (
            "attention_backward (dq)",
            q,
            q + 1,
            attention_bwd([q, q, kv, kv, q, lse, q + 1, kv, kv]),
        ),
        (
            "attention_backward (dk)",
            kv,
            kv + 1,
            attention_bwd([q, q, kv, kv, q, lse, q, kv + 1, kv]),
        ),
        (
            "attention_backward (dv)",
            kv,
            kv + 1,
            attention_bwd([q, q, kv, kv, q, lse, q, kv, kv + 1]),
        ),
        (
            "cross_entropy (logits = targets x vocab)",
            3 * VOCAB,
            3 * VOCAB + 1,
            cross_entropy(false, 3 * VOCAB + 1),
        ),
        (
            "cross_entropy (logits = targets x vocab)",
            3 * VOCAB,
            3 * VOCAB + 1,
            cross_entropy(true, 3 * VOCAB + 1),
        ),
        (
            "layernorm_forward (x)",
            16,
            13,
            layernorm_fwd([13, I, I, 13, R, R]),
        ),
        (
            "layernorm_forward (weight)",
            I,
            I + 1,
            layernorm_fwd([R * I, I + 1, I, R * I, R, R]),
        ),
        (
            "layernorm_forward (bias)",
            I,
            I + 1,
            layernorm_fwd([R * I, I, I + 1, R * I, R, R]),
        ),
        (
            "layernorm_forward (out)",
            R * I,
            R * I + 1,
            layernorm_fwd([R * I, I, I, R * I + 1, R, R]),
        ),
        (
            "layernorm_forward (mean)",
            R,
            R + 1,
            layernorm_fwd([R * I, I, I, R * I, R + 1, R]),
        ),
        (
            "layernorm_forward (rstd)",
            R,
            R + 1,
            layernorm_fwd([R * I, I, I, R * I, R, R + 1]),
        ),
        (
            "layernorm_backward (weight)",
            I,
            I + 1,
            layernorm_bwd([R * I, R * I, I + 1, R, R, R * I, I, I]),
        ),
        (
            "layernorm_backward (dweight)",
            I,
            I + 1,
            layernorm_bwd([R * I, R * I, I, R, R, R * I, I + 1, I]),
        ),
        (
            "layernorm_backward (dbias)",
            I,
            I + 1,
            layernorm_bwd([R * I, R * I, I, R, R, R * I, I, I + 1]),
        ),
        (
            "layernorm_backward (dout)",
            R * I,
            R * I + 1,
            layernorm_bwd([R * I + 1, R * I, I, R, R, R * I, I, I]),
        ),
        (
            "layernorm_backward (dx)",
            R * I,
            R * I + 1,
            layernorm_bwd([R * I, R * I, I, R, R, R * I + 1, I, I]),
        ),
        (
            "layernorm_backward (mean)",
            R,
            R + 1,
            layernorm_bwd([R * I, R * I, I, R + 1, R, R * I, I, I]),
        ),
        (
            "layernorm_backward (rstd)",
            R,
            R + 1,
            layernorm_bwd([R * I, R * I, I, R, R + 1, R * I, I, I]),
        ),
        ("gelu_tanh_forward (out)", N, N + 1, gelu_fwd([N, N + 1])),
        ("gelu_tanh_backward (x)", N, N + 1, gelu_bwd([N, N + 1, N])),
        ("gelu_tanh_backward (dx)", N, N + 1, gelu_bwd([N, N, N + 1])),
    ];
    for (want_op, want_expected, want_actual, (result, outputs_untouched)) in cases {
        match result {
            Err(OpsError::ShapeMismatch {
                op,
                expected,
                actual,
            }) => assert_eq!(
                (op, expected, actual),
                (want_op, want_expected, want_actual),
                "the error names another argument or count"
            ),
            other => panic!("{want_op}: expected a ShapeMismatch, got {other:?}"),
        }
        assert!(
            outputs_untouched,
            "{want_op}: an output was written before the error"
        );
    }
}

/// A product of dimensions that overflows `usize` is a shape error, not a wrapped length that
/// could happen to match a slice.
#[test]
fn overflowing_dimensions_are_shape_errors() {
    let mut out = output(0);
    let err = linear_forward::<f64>(&[], &[], None, usize::MAX, 2, 1, &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            OpsError::ShapeMismatch {
                op: "linear_forward (x)",
                expected: usize::MAX,
                actual: 0
            }
        ),
        "{err:?}"
    );
}
