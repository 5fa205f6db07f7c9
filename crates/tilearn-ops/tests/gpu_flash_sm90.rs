//! The Hopper flash-attention kernels (wgmma, `flash_attention_sm90.cu`) against the mma.sync
//! ones (`flash_attention.cu`, chosen with `TILEARN_FLASH_SM80=1`) on the same fresh random
//! inputs. Both are checked against the f64 CPU reference elsewhere (`gpu_matmul_attention.rs`
//! runs its flash cases on whatever the device picks, which on an H200 is these kernels); this
//! file pins down how the two relate:
//!
//! * the backward, given the same `out` and `lse`, is bit-identical (same 64-row tiles, the same
//!   products in the same order, the same roundings);
//! * the forward agrees to the rounding: it walks keys in blocks of 128 (mma.sync: 64), so the
//!   online softmax rescales at other points; bf16 `out` within 1e-2 of the norm (each path is
//!   ~2-4e-3 rms from the exact answer), f16 within 2e-3, lse within 1e-6.
//!
//! Shapes cover a partial last tile on either side of 128 (T = 130, 333), one tile (T = 64), a
//! GQA group of 8 (TinyLlama's) and plain multi-head. One test only: it switches the kernels by
//! setting an environment variable, which nothing else in this process reads concurrently.
//!
//! Without a GPU, or on a GPU other than compute capability 9.0, the test prints `skipped: ...`
//! and passes.
#![cfg(feature = "cuda")]

mod gpu_common;

use gpu_common::{Elem, download, gpu_or_skip, random, rel_err, report, shape, upload};
use half::{bf16, f16};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cpu::AttnShape;
use tilearn_ops::cuda::{self, AttentionImpl, AttentionWorkspace, Gemm, GpuDevice};

const SWITCH: &str = "TILEARN_FLASH_SM80";

/// Runs `f` with the mma.sync kernels forced (`sm80`) or the device's choice.
fn with_kernels<R>(sm80: bool, f: impl FnOnce() -> R) -> R {
    // SAFETY: this file's single test is the only thread of the process that touches the
    // environment while it runs (libtest starts no other test here).
    unsafe {
        if sm80 {
            std::env::set_var(SWITCH, "1");
        } else {
            std::env::remove_var(SWITCH);
        }
    }
    let r = f();
    // SAFETY: as above.
    unsafe { std::env::remove_var(SWITCH) };
    r
}

fn widen<T: Elem>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// One shape in `T`: forwards of both kernel families compared to the rounding, then both
/// backwards from the mma.sync forward's `out` and `lse` compared bit for bit.
fn compare<T: Elem>(dev: &GpuDevice, gemm: &Gemm, s: AttnShape, seed: u64, tol_out: f64) {
    let tag = format!("{} {s:?}", std::any::type_name::<T>());
    let st = dev.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let ql = s.batch * s.seq * s.q_heads * s.head_dim;
    let kvl = s.batch * s.seq * s.kv_heads * s.head_dim;
    let rows = s.batch * s.q_heads * s.seq;
    let (q, _) = random::<T>(&mut rng, ql, 0.05, 2.0);
    let (k, _) = random::<T>(&mut rng, kvl, 0.05, 2.0);
    let (v, _) = random::<T>(&mut rng, kvl, 0.05, 1.0);
    let (dout, _) = random::<T>(&mut rng, ql, 0.05, 1.0);
    let (q, k, v, dout) = (
        upload(st, &q),
        upload(st, &k),
        upload(st, &v),
        upload(st, &dout),
    );
    let mut ws = AttentionWorkspace::new(st, s, size_of::<T>()).unwrap();
    let imp = AttentionImpl::Flash;

    let mut forward = |sm80: bool| {
        let mut out = upload(st, &vec![T::NAN; ql]);
        let mut lse = upload(st, &vec![f32::NAN; rows]);
        with_kernels(sm80, || {
            cuda::attention_forward_with(imp, gemm, &mut ws, s, &q, &k, &v, &mut out, &mut lse)
        })
        .unwrap();
        (out, lse)
    };
    let (out_ref, lse_ref) = forward(true);
    let (out_new, lse_new) = forward(false);
    let out_err = rel_err(
        "out",
        &widen(&download(dev, &out_new)),
        &widen(&download(dev, &out_ref)),
    );
    let lse_of = |b| {
        download(dev, b)
            .iter()
            .map(|&x: &f32| x as f64)
            .collect::<Vec<_>>()
    };
    let lse_err = rel_err("lse", &lse_of(&lse_new), &lse_of(&lse_ref));

    let mut backward = |sm80: bool| {
        let mut dq = upload(st, &vec![T::NAN; ql]);
        let mut dk = upload(st, &vec![T::NAN; kvl]);
        let mut dv = upload(st, &vec![T::NAN; kvl]);
        with_kernels(sm80, || {
            cuda::attention_backward_with(
                imp, gemm, &mut ws, s, &dout, &q, &k, &v, &out_ref, &lse_ref, &mut dq, &mut dk,
                &mut dv,
            )
        })
        .unwrap();
        [dq, dk, dv].map(|b| {
            download(dev, &b)
                .iter()
                .map(|x| x.bits())
                .collect::<Vec<_>>()
        })
    };
    let grads_ref = backward(true);
    let grads_new = backward(false);
    let differing: Vec<usize> = grads_ref
        .iter()
        .zip(&grads_new)
        .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count())
        .collect();
    report(&format!(
        "gpu_flash_sm90: {tag}: forward out {out_err:.2e} (tol {tol_out:.0e}), lse {lse_err:.2e} \
         (tol 1e-6); backward values differing (dq, dk, dv): {differing:?}"
    ));
    assert!(
        out_err <= tol_out,
        "{tag}: out {out_err:.2e} > {tol_out:.0e}"
    );
    assert!(lse_err <= 1e-6, "{tag}: lse {lse_err:.2e} > 1e-6");
    assert_eq!(differing, [0, 0, 0], "{tag}: the backwards differ");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn hopper_flash_kernels_match_the_mma_sync_kernels() {
    const TEST: &str = "hopper_flash_kernels_match_the_mma_sync_kernels";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    if !cuda::flash_attention_uses_wgmma::<bf16>(64, false) {
        report(&format!(
            "skipped: {TEST}: the device does not run the Hopper kernels (needs compute \
             capability 9.0 and TILEARN_FLASH_SM80 unset)"
        ));
        return;
    }
    for (i, &(b, t, hq, hkv)) in [
        (1, 130, 2, 1),
        (2, 333, 8, 1),
        (3, 64, 4, 4),
        (1, 1000, 16, 2),
    ]
    .iter()
    .enumerate()
    {
        compare::<bf16>(&dev, &gemm, shape(b, t, hq, hkv, 64), 100 + i as u64, 1e-2);
    }
    compare::<f16>(&dev, &gemm, shape(2, 257, 4, 2, 64), 200, 2e-3);
    // head_dim 128 and masked calls stay on the mma.sync kernels.
    assert!(!cuda::flash_attention_uses_wgmma::<bf16>(128, false));
    assert!(!cuda::flash_attention_uses_wgmma::<bf16>(64, true));
}
