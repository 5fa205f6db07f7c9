//! The generation kernels against their references, on fresh seeded random inputs (never
//! zeros), in f32, bf16 and f16:
//! * `cached_attention.cu` (n new queries against a key/value cache, GQA) against
//!   [`cpu::cached_attention`] on the same rounded inputs, for a single decoded token deep in the
//!   cache, a prefill, a continued prefill chunk, head sizes 64, 80 (not a multiple of the warp)
//!   and 128, with the cache's unused tail and the output poisoned with NaN (a read past
//!   `start + n`, or an output the kernel forgets, fails the test);
//! * `rope_forward_from` (RoPE of a chunk at absolute positions) bit-identical to the same kernel
//!   over the whole sequence, and within f32 rounding of the CPU rotation.
//!
//! Tolerances (‖got − want‖₂ / ‖want‖₂ against the f32 CPU reference on the same inputs): f32
//! 1e-5 (the kernel's online softmax and the reference's two-pass softmax differ only in
//! summation order, ~1e-7 per sum); bf16 1e-2 and f16 2e-3: the output is rounded once to the
//! type (unit roundoff 3.9e-3 and 4.9e-4), as DESIGN.md's bounds.
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

use std::io::Write;

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cpu::{self, CachedAttnShape, RopeScaling, RopeTable};
use tilearn_ops::cuda::{self, DeviceFloat, GpuDevice, GpuRopeTable};

fn report(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

fn gpu_or_skip(test: &str) -> Option<GpuDevice> {
    match GpuDevice::new(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            report(&format!("skipped: {test}: {e}"));
            None
        }
    }
}

/// Uniform in ±[0.05, 2): bounded away from zero.
fn values<T: DeviceFloat>(rng: &mut ChaCha8Rng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| {
            let m: f32 = rng.random_range(0.05..2.0);
            T::from_f32(if rng.random::<bool>() { m } else { -m })
        })
        .collect()
}

fn widen<T: DeviceFloat>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        num += f64::from(g - w).powi(2);
        den += f64::from(*w).powi(2);
    }
    (num / den).sqrt()
}

fn tol<T: DeviceFloat>() -> f64 {
    match T::NAME {
        "f32" => 1e-5,
        "bf16" => 1e-2,
        _ => 2e-3,
    }
}

fn cached_attention_case<T: DeviceFloat>(test: &str) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    // (n, start, q_heads, kv_heads, head_dim, spare cache positions after start + n)
    let cases = [
        (1, 0, 12, 4, 64, 7),
        (1, 300, 12, 4, 64, 20),
        (19, 0, 8, 8, 80, 3),
        (5, 40, 32, 8, 128, 0),
        (3, 9, 6, 2, 80, 1),
    ];
    for (n, start, q_heads, kv_heads, head_dim, spare) in cases {
        let shape = CachedAttnShape {
            n,
            start,
            q_heads,
            kv_heads,
            head_dim,
        };
        let written = shape.kv_len();
        let total = written + spare * kv_heads * head_dim;
        let q: Vec<T> = values(&mut rng, shape.q_len());
        let mut k: Vec<T> = values(&mut rng, total);
        let mut v: Vec<T> = values(&mut rng, total);
        let mut want = vec![0.0f32; shape.q_len()];
        cpu::cached_attention(
            shape,
            &widen(&q),
            &widen(&k[..written]),
            &widen(&v[..written]),
            &mut want,
        )
        .unwrap();
        // Positions past start + n are not part of the sequence yet: poison them.
        k[written..].fill(T::from_f32(f32::NAN));
        v[written..].fill(T::from_f32(f32::NAN));
        let (dq, dk, dv) = (
            s.clone_htod(&q).unwrap(),
            s.clone_htod(&k).unwrap(),
            s.clone_htod(&v).unwrap(),
        );
        let mut out = s
            .clone_htod(&vec![T::from_f32(f32::NAN); shape.q_len()])
            .unwrap();
        cuda::cached_attention_forward(s, shape, &dq, &dk, &dv, &mut out).unwrap();
        dev.synchronize().unwrap();
        let got = widen(&s.clone_dtoh(&out).unwrap());
        let err = rel_err(&got, &want);
        report(&format!(
            "{test}: n {n} start {start} heads {q_heads}/{kv_heads} d {head_dim}: rel err \
             {err:.2e} (tol {:e})",
            tol::<T>()
        ));
        assert!(err <= tol::<T>(), "{test}: {shape:?}: rel err {err:e}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn cached_attention_matches_the_cpu_f32() {
    cached_attention_case::<f32>("cached_attention_matches_the_cpu_f32");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn cached_attention_matches_the_cpu_bf16() {
    cached_attention_case::<bf16>("cached_attention_matches_the_cpu_bf16");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn cached_attention_matches_the_cpu_f16() {
    cached_attention_case::<f16>("cached_attention_matches_the_cpu_f16");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn cached_attention_refuses_what_it_does_not_serve() {
    let test = "cached_attention_refuses_what_it_does_not_serve";
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let ok = CachedAttnShape {
        n: 2,
        start: 3,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 64,
    };
    let q = s.alloc_zeros::<f32>(ok.q_len()).unwrap();
    let kv = s.alloc_zeros::<f32>(ok.kv_len()).unwrap();
    let mut out = s.alloc_zeros::<f32>(ok.q_len()).unwrap();
    let short = s.alloc_zeros::<f32>(ok.kv_len() - 1).unwrap();
    let err = cuda::cached_attention_forward(s, ok, &q, &short, &kv, &mut out).unwrap_err();
    assert!(err.to_string().contains("k cache"), "{err}");
    let ragged = CachedAttnShape { kv_heads: 3, ..ok };
    assert!(cuda::cached_attention_forward(s, ragged, &q, &kv, &kv, &mut out).is_err());
    let wide = CachedAttnShape {
        head_dim: 512,
        n: 1,
        start: 0,
        q_heads: 1,
        kv_heads: 1,
    };
    let big = s.alloc_zeros::<f32>(512).unwrap();
    let mut big_out = s.alloc_zeros::<f32>(512).unwrap();
    let err = cuda::cached_attention_forward(s, wide, &big, &big, &big, &mut big_out).unwrap_err();
    assert!(err.to_string().contains("head_dim"), "{err}");
    report(&format!(
        "{test}: refused a short cache, ragged heads and head_dim 512"
    ));
}

fn rope_at_case<T: DeviceFloat>(test: &str) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (heads, head_dim, len, start) = (6, 64, 50, 37);
    let table = RopeTable::new(head_dim, 10000.0, &RopeScaling::None, len, len);
    let gpu_table = GpuRopeTable::upload(s, &table).unwrap();
    let row = heads * head_dim;
    let x: Vec<T> = values(&mut rng, len * row);
    // The whole sequence through rope_forward, and its tail through rope_forward_from.
    let mut whole = s.clone_htod(&x).unwrap();
    cuda::rope_forward(s, &mut whole, 1, len, heads, head_dim, &gpu_table).unwrap();
    let mut dev_tail = s.clone_htod(&x[start * row..]).unwrap();
    cuda::rope_forward_from(
        s,
        &mut dev_tail,
        len - start,
        heads,
        head_dim,
        &gpu_table,
        start,
    )
    .unwrap();
    dev.synchronize().unwrap();
    let whole = s.clone_dtoh(&whole).unwrap();
    let tail = s.clone_dtoh(&dev_tail).unwrap();
    let bits = |v: &[T]| widen(v).iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&tail),
        bits(&whole[start * row..]),
        "{test}: the chunk at position {start} must rotate like those rows of the sequence"
    );
    let mut cpu_x = widen(&x);
    cpu::rope_forward(&mut cpu_x, 1, len, heads, head_dim, &table).unwrap();
    let err = rel_err(&widen(&tail), &cpu_x[start * row..]);
    report(&format!(
        "{test}: rows {start}..{len} bit-identical to the whole-sequence rotation; vs CPU rel \
         err {err:.2e} (tol {:e})",
        tol::<T>()
    ));
    assert!(err <= tol::<T>());
    let err = cuda::rope_forward_from(
        s,
        &mut dev_tail,
        len - start,
        heads,
        head_dim,
        &gpu_table,
        38,
    )
    .unwrap_err();
    assert!(err.to_string().contains("exceed"), "{err}");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn rope_at_a_position_rotates_like_the_whole_sequence_f32() {
    rope_at_case::<f32>("rope_at_a_position_rotates_like_the_whole_sequence_f32");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn rope_at_a_position_rotates_like_the_whole_sequence_bf16() {
    rope_at_case::<bf16>("rope_at_a_position_rotates_like_the_whole_sequence_bf16");
}
