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
//! GQA group of 8 (TinyLlama's) and plain multi-head. The test switches the kernels by setting
//! an environment variable; the tests of this file hold one lock ([`KERNELS`]) for their whole
//! run, so nothing reads the environment while it changes.
//!
//! The one-pass backward (a [`FlashBackward::OnePass`] workspace: dK, dV and dQ in one kernel,
//! dQ summed by f32 atomic adds into the workspace's `dq_accum`) against the deterministic one
//! on the same fresh random inputs, `out` and `lse`:
//!
//! * dk and dv are computed as in the deterministic backward: equal within 1e-6 relative (the
//!   number of differing values is printed; bit-identical is expected);
//! * dq is the same sum in another order, rounded once to the element type: within 2e-3 of the
//!   norm in bf16 and 1e-3 in f16 (the order moves the f32 sum by ~1e-7 relative; what remains
//!   is the occasional value whose 16-bit rounding flips, 2^-8 or 2^-11 of it), and two
//!   one-pass runs agree with each other within the same bound (the second also shows that
//!   `dq_accum` is overwritten, not added to);
//! * a call larger than the one-pass workspace's shape, and a masked call, run the
//!   deterministic backward: bit-identical to it.
//!
//! Shapes: GQA groups of 2 and 8, T = 130 and 333 (partial last tiles), one tile, bf16 and f16,
//! and TinyLlama's heads (32 / 4) at 2 × 1024 tokens.
//!
//! The head_dim-128 kernels (the default on Hopper; `TILEARN_FLASH_SM90_HD128=0` turns them
//! off: forward and the deterministic two-kernel backward; no one-pass backward) against the
//! mma.sync kernels: the forward with the same bounds, the backward bit for bit, at GQA groups
//! of 2 and 8, plain multi-head (the 7B shape's 32 heads at T = 1000), partial tiles, bf16 and
//! f16.
//!
//! The head_dim-64 forward's TMA loads (the default) against its cp.async loads
//! (`TILEARN_FLASH_SM90_FWD_TMA=0`): bit for bit, with several batch entries and partial last
//! key blocks. The one-pass backward's Q / dO by TMA (the default) against its cp.async loads
//! (`TILEARN_FLASH_SM90_BWD_TMA=0`): dk and dv bit for bit, dq within the one-pass bound (the
//! reduce-adds' order differs from run to run).
//!
//! Without a GPU, or on a GPU other than compute capability 9.0, the tests print `skipped: ...`
//! and pass.
#![cfg(feature = "cuda")]

mod gpu_common;

use std::sync::{Mutex, MutexGuard};

use gpu_common::{Elem, download, gpu_or_skip, random, rel_err, report, shape, upload};
use half::{bf16, f16};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tilearn_ops::KeyMask;
use tilearn_ops::cpu::AttnShape;
use tilearn_ops::cuda::{
    self, AttentionImpl, AttentionWorkspace, CudaSlice, FlashBackward, Gemm, GpuDevice,
    flash_dq_accum_len,
};

const SWITCH: &str = "TILEARN_FLASH_SM80";

/// `0` keeps the head_dim-128 forward on the mma.sync kernels (unset: the Hopper kernel).
const HD128: &str = "TILEARN_FLASH_SM90_HD128";

/// Held by each test of this file for its whole run: one of them sets and removes
/// [`SWITCH`], and every kernel launch reads it.
static KERNELS: Mutex<()> = Mutex::new(());

fn kernels_lock() -> MutexGuard<'static, ()> {
    // A test that failed while holding the lock leaves the environment as it found it.
    KERNELS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The kernel lock, the device and its GEMM handle when the device runs the Hopper kernels;
/// `None` (and a printed reason) on a machine without a GPU or with another one.
fn hopper_or_skip(test: &str) -> Option<(MutexGuard<'static, ()>, GpuDevice, Gemm)> {
    let kernels = kernels_lock();
    let (dev, gemm) = gpu_or_skip(test)?;
    if !cuda::flash_attention_uses_wgmma::<bf16>(64, false) {
        report(&format!(
            "skipped: {test}: the device does not run the Hopper kernels (needs compute \
             capability 9.0 and TILEARN_FLASH_SM80 unset)"
        ));
        return None;
    }
    Some((kernels, dev, gemm))
}

/// Runs `f` with the environment variable `var` set to `value`, then removes it (every switch
/// this file sets is unset by default).
fn with_env<R>(var: &str, value: &str, f: impl FnOnce() -> R) -> R {
    // SAFETY: the caller holds `KERNELS`, as every test of this file does for its whole run,
    // and this file's tests are the only threads of the process that launch kernels or touch
    // the environment.
    unsafe { std::env::set_var(var, value) };
    let r = f();
    // SAFETY: as above.
    unsafe { std::env::remove_var(var) };
    r
}

/// Runs `f` with the mma.sync kernels forced (`sm80`) or the device's choice.
fn with_kernels<R>(sm80: bool, f: impl FnOnce() -> R) -> R {
    // The kernels read an empty TILEARN_FLASH_SM80 as unset.
    with_env(SWITCH, if sm80 { "1" } else { "" }, f)
}

fn widen<T: Elem>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// One shape in `T`: forwards of both kernel families compared to the rounding, then both
/// backwards from the mma.sync forward's `out` and `lse` compared bit for bit (their relative
/// errors are printed too, to size a difference should one appear).
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
        [dq, dk, dv].map(|b| download(dev, &b))
    };
    let grads_ref = backward(true);
    let grads_new = backward(false);
    let differing: Vec<usize> = grads_ref
        .iter()
        .zip(&grads_new)
        .map(|(a, b)| {
            a.iter()
                .zip(b)
                .filter(|(x, y)| x.bits() != y.bits())
                .count()
        })
        .collect();
    let grad_errs: Vec<f64> = ["dq", "dk", "dv"]
        .iter()
        .zip(grads_ref.iter().zip(&grads_new))
        .map(|(name, (r, n))| rel_err(name, &widen(n), &widen(r)))
        .collect();
    let errs = grad_errs
        .iter()
        .map(|e| format!("{e:.2e}"))
        .collect::<Vec<_>>()
        .join(", ");
    report(&format!(
        "gpu_flash_sm90: {tag}: forward out {out_err:.2e} (tol {tol_out:.0e}), lse {lse_err:.2e} \
         (tol 1e-6); backward values differing (dq, dk, dv): {differing:?}, relative errors \
         [{errs}]"
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
    let Some((_kernels, dev, gemm)) = hopper_or_skip(TEST) else {
        return;
    };
    for (i, &(b, t, hq, hkv)) in [
        (1, 130, 2, 1),
        (2, 333, 8, 1),
        (3, 64, 4, 4),
        (1, 1000, 16, 2),
    ]
    .iter()
    .enumerate()
    {
        let s = shape(b, t, hq, hkv, 64);
        compare::<bf16>(&dev, &gemm, s, 100 + i as u64, 1e-2);
    }
    compare::<f16>(&dev, &gemm, shape(2, 257, 4, 2, 64), 200, 2e-3);
    // Masked calls stay on the mma.sync kernels; the one-pass backward is head_dim 64's alone.
    assert!(!cuda::flash_attention_uses_wgmma::<bf16>(64, true));
    assert!(cuda::flash_attention_one_pass::<bf16>(64, false));
    assert!(!cuda::flash_attention_one_pass::<bf16>(64, true));
    assert!(!cuda::flash_attention_one_pass::<bf16>(128, false));
}

/// The head_dim-128 Hopper kernels (the default; `TILEARN_FLASH_SM90_HD128=0` turns them off:
/// two 64-wide panels per tile row; the forward walks key blocks of 64, the backward is the
/// two-kernel one) against the mma.sync kernels, as `compare` does for head_dim 64: the
/// backward sums the same products in the same order as mma.sync's (panel 0's k-steps, then
/// panel 1's, into one accumulator), so it is bit-identical.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn the_head_dim_128_kernels_match_the_mma_sync_kernels() {
    const TEST: &str = "the_head_dim_128_kernels_match_the_mma_sync_kernels";
    let Some((_kernels, dev, gemm)) = hopper_or_skip(TEST) else {
        return;
    };
    // Unset (which with_env leaves behind) is the default: on.
    let off = with_env(HD128, "0", || {
        cuda::flash_attention_uses_wgmma::<bf16>(128, false)
    });
    assert!(cuda::flash_attention_uses_wgmma::<bf16>(128, false));
    assert!(
        !off,
        "TILEARN_FLASH_SM90_HD128=0 keeps head_dim 128 on mma.sync"
    );
    for (i, &(b, t, hq, hkv)) in [
        (1, 130, 2, 1),
        (2, 333, 8, 1),
        (3, 64, 4, 4),
        (1, 1000, 32, 32),
    ]
    .iter()
    .enumerate()
    {
        let s = shape(b, t, hq, hkv, 128);
        compare::<bf16>(&dev, &gemm, s, 300 + i as u64, 1e-2);
    }
    let s = shape(2, 257, 4, 2, 128);
    compare::<f16>(&dev, &gemm, s, 400, 2e-3);
}

/// (batch, seq, q_heads, kv_heads) of the TMA tests in bf16: several batch entries with partial
/// last blocks (the tensor maps' bounds), one tile, TinyLlama's GQA group of 8.
const TMA_SHAPES_BF16: [(usize, usize, usize, usize); 4] = [
    (3, 130, 2, 1),
    (2, 333, 8, 1),
    (1, 64, 4, 4),
    (2, 1024, 32, 4),
];

/// The same in f16.
const TMA_SHAPE_F16: (usize, usize, usize, usize) = (2, 257, 4, 2);

/// `0` loads the head_dim-64 forward's K / V with cp.async (`fwd_kernel`); `1` with TMA
/// (`fwd_tma_kernel`) or fails; unset, TMA where the driver encodes its tensor maps.
const FWD_TMA: &str = "TILEARN_FLASH_SM90_FWD_TMA";

/// The TMA forward against the cp.async one at one shape: the same products in the same order,
/// so `out` and `lse` are the same bits. Several batch entries and a partial last key block
/// check the tensor maps' bounds (keys past seq are zeros, not the next entry's).
fn tma_case<T: Elem>(dev: &GpuDevice, gemm: &Gemm, s: AttnShape, seed: u64) {
    // `1`: TMA or an error, so the comparison cannot pass by measuring the cp.async fallback
    // against itself.
    let p = with_env(FWD_TMA, "1", || Problem::<T>::new(dev, gemm, s, seed, None));
    let st = dev.stream();
    let mut out = upload(st, &vec![T::NAN; p.out.len()]);
    let mut lse = upload(st, &vec![f32::NAN; p.lse.len()]);
    let mut ws = AttentionWorkspace::for_flash(st, s, FlashBackward::Deterministic).unwrap();
    with_env(FWD_TMA, "0", || {
        cuda::attention_forward_masked(
            AttentionImpl::Flash,
            gemm,
            &mut ws,
            s,
            key_mask(None),
            &p.q,
            &p.k,
            &p.v,
            &mut out,
            &mut lse,
        )
    })
    .unwrap();
    let out_diff = download(dev, &p.out)
        .iter()
        .zip(&download(dev, &out))
        .filter(|(a, b)| a.bits() != b.bits())
        .count();
    let lse_diff = download(dev, &p.lse)
        .iter()
        .zip(&download(dev, &lse))
        .filter(|(a, b): &(&f32, &f32)| a.to_bits() != b.to_bits())
        .count();
    let tag = format!("{} {s:?}", std::any::type_name::<T>());
    report(&format!(
        "gpu_flash_sm90: {tag}: TMA forward against cp.async: out values differing {out_diff}, \
         lse {lse_diff}"
    ));
    assert_eq!((out_diff, lse_diff), (0, 0), "{tag}: the forwards differ");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn the_tma_forward_matches_the_cp_async_forward_bit_for_bit() {
    const TEST: &str = "the_tma_forward_matches_the_cp_async_forward_bit_for_bit";
    let Some((_kernels, dev, gemm)) = hopper_or_skip(TEST) else {
        return;
    };
    for (i, &(b, t, hq, hkv)) in TMA_SHAPES_BF16.iter().enumerate() {
        tma_case::<bf16>(&dev, &gemm, shape(b, t, hq, hkv, 64), 500 + i as u64);
    }
    let (b, t, hq, hkv) = TMA_SHAPE_F16;
    tma_case::<f16>(&dev, &gemm, shape(b, t, hq, hkv, 64), 600);
}

/// Fresh random inputs of one attention problem in `T` and the forward's `out` and `lse` (the
/// device's flash kernels, under `mask` when given).
struct Problem<T: Elem> {
    s: AttnShape,
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    dout: CudaSlice<T>,
    out: CudaSlice<T>,
    lse: CudaSlice<f32>,
}

/// A sliding window of keys (a masked call: the mma.sync kernels run it).
type Window = Option<usize>;

fn key_mask(window: Window) -> KeyMask<&'static CudaSlice<i32>> {
    KeyMask {
        positions: None,
        sliding_window: window,
    }
}

impl<T: Elem> Problem<T> {
    fn new(dev: &GpuDevice, gemm: &Gemm, s: AttnShape, seed: u64, window: Window) -> Self {
        let st = dev.stream();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let ql = s.batch * s.seq * s.q_heads * s.head_dim;
        let kvl = s.batch * s.seq * s.kv_heads * s.head_dim;
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
        let mut out = upload(st, &vec![T::NAN; ql]);
        let mut lse = upload(st, &vec![f32::NAN; s.batch * s.q_heads * s.seq]);
        let mut ws = AttentionWorkspace::for_flash(st, s, FlashBackward::Deterministic).unwrap();
        cuda::attention_forward_masked(
            AttentionImpl::Flash,
            gemm,
            &mut ws,
            s,
            key_mask(window),
            &q,
            &k,
            &v,
            &mut out,
            &mut lse,
        )
        .unwrap();
        Problem {
            s,
            q,
            k,
            v,
            dout,
            out,
            lse,
        }
    }

    /// dq, dk and dv (widened to f64) of the flash backward through `ws`, from NaN-poisoned
    /// outputs, each checked finite (every value written).
    fn backward(
        &self,
        dev: &GpuDevice,
        gemm: &Gemm,
        ws: &mut AttentionWorkspace,
        window: Window,
        lent: Option<&mut CudaSlice<f32>>,
    ) -> [Vec<f64>; 3] {
        let st = dev.stream();
        let s = self.s;
        let ql = s.batch * s.seq * s.q_heads * s.head_dim;
        let kvl = s.batch * s.seq * s.kv_heads * s.head_dim;
        let mut dq = upload(st, &vec![T::NAN; ql]);
        let mut dk = upload(st, &vec![T::NAN; kvl]);
        let mut dv = upload(st, &vec![T::NAN; kvl]);
        let mut lent = lent.map(|buf| buf.as_view_mut());
        cuda::attention_backward_lent(
            AttentionImpl::Flash,
            gemm,
            ws,
            s,
            key_mask(window),
            None::<&CudaSlice<f32>>,
            &self.dout,
            &self.q,
            &self.k,
            &self.v,
            &self.out,
            &self.lse,
            &mut dq,
            &mut dk,
            &mut dv,
            lent.as_mut(),
        )
        .unwrap();
        let grads = [dq, dk, dv].map(|b| {
            download(dev, &b)
                .iter()
                .map(|x| x.to_f64())
                .collect::<Vec<_>>()
        });
        for (what, g) in ["dq", "dk", "dv"].iter().zip(&grads) {
            if let Some(i) = g.iter().position(|x| !x.is_finite()) {
                panic!("{s:?}: {what}[{i}] is {} (not written?)", g[i]);
            }
        }
        grads
    }
}

/// How many values of `a` and `b` differ.
fn differing(a: &[f64], b: &[f64]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// One shape in `T`: the one-pass backward (twice) against the deterministic one, then a call
/// too large for a one-pass workspace and a masked call, which must run the deterministic
/// backward. `tol_dq`: dq's bound (see the file's documentation).
fn one_pass_case<T: Elem>(dev: &GpuDevice, gemm: &Gemm, s: AttnShape, seed: u64, tol_dq: f64) {
    const TOL_DKV: f64 = 1e-6;
    let tag = format!("{} {s:?}", std::any::type_name::<T>());
    let st = dev.stream();
    let mut det = AttentionWorkspace::for_flash(st, s, FlashBackward::Deterministic).unwrap();
    let mut one = AttentionWorkspace::for_flash(st, s, FlashBackward::OnePass).unwrap();
    assert_eq!(
        det.flash_backward_for::<T>(s, false),
        FlashBackward::Deterministic
    );
    assert_eq!(
        one.flash_backward_for::<T>(s, false),
        FlashBackward::OnePass,
        "{tag}"
    );
    assert_eq!(
        one.flash_backward_for::<T>(s, true),
        FlashBackward::Deterministic
    );
    let accum_bytes = 4 * flash_dq_accum_len(s).unwrap();
    assert!(
        one.bytes() >= det.bytes() + accum_bytes,
        "{tag}: the one-pass workspace ({} bytes) lacks the {accum_bytes} bytes of dq_accum",
        one.bytes()
    );

    let p = Problem::<T>::new(dev, gemm, s, seed, None);
    let [dq_d, dk_d, dv_d] = p.backward(dev, gemm, &mut det, None, None);
    let [dq_1, dk_1, dv_1] = p.backward(dev, gemm, &mut one, None, None);
    let [dq_2, dk_2, dv_2] = p.backward(dev, gemm, &mut one, None, None);
    let errs = [
        ("dq", rel_err("dq", &dq_1, &dq_d), tol_dq),
        ("dk", rel_err("dk", &dk_1, &dk_d), TOL_DKV),
        ("dv", rel_err("dv", &dv_1, &dv_d), TOL_DKV),
        ("dq run 2 vs run 1", rel_err("dq", &dq_2, &dq_1), tol_dq),
        ("dk run 2 vs run 1", rel_err("dk", &dk_2, &dk_1), TOL_DKV),
        ("dv run 2 vs run 1", rel_err("dv", &dv_2, &dv_1), TOL_DKV),
    ];
    report(&format!(
        "gpu_flash_sm90: one-pass vs deterministic {tag}: {}; values differing (dq, dk, dv): \
         {:?}, run 2 vs run 1: {:?}",
        errs.iter()
            .map(|(what, err, tol)| format!("{what} {err:.2e} (tol {tol:.0e})"))
            .collect::<Vec<_>>()
            .join(", "),
        [
            differing(&dq_1, &dq_d),
            differing(&dk_1, &dk_d),
            differing(&dv_1, &dv_d)
        ],
        [
            differing(&dq_2, &dq_1),
            differing(&dk_2, &dk_1),
            differing(&dv_2, &dv_1)
        ],
    ));
    for (what, err, tol) in errs {
        assert!(err <= tol, "{tag}: {what}: {err:.2e} > {tol:.0e}");
    }

    // A workspace that borrows its dq_accum holds only delta. Lent enough (NaN-filled: the
    // backward clears it), it runs the one-pass backward: dk and dv the same bits as with its
    // own scratch, dq within the bound; lent one float too few, or nothing, the deterministic
    // backward bit for bit.
    let mut lending = AttentionWorkspace::for_flash_lent(st, s).unwrap();
    assert!(
        lending.lends_dq_accum() && lending.bytes() == det.bytes(),
        "{tag}"
    );
    assert_eq!(
        lending.flash_backward_for::<T>(s, false),
        FlashBackward::OnePass
    );
    let len = flash_dq_accum_len(s).unwrap();
    let mut lent = upload(st, &vec![f32::NAN; len]);
    let [dq_l, dk_l, dv_l] = p.backward(dev, gemm, &mut lending, None, Some(&mut lent));
    assert_eq!(
        [differing(&dk_l, &dk_1), differing(&dv_l, &dv_1)],
        [0, 0],
        "{tag}: lent dq_accum: dk, dv"
    );
    let err = rel_err("dq", &dq_l, &dq_d);
    report(&format!(
        "gpu_flash_sm90: lent dq_accum {tag}: dq vs deterministic {err:.2e}"
    ));
    assert!(
        err <= tol_dq,
        "{tag}: lent dq_accum: dq {err:.2e} > {tol_dq:.0e}"
    );
    let mut short = upload(st, &vec![0f32; len - 1]);
    for lent in [Some(&mut short), None] {
        let got = p.backward(dev, gemm, &mut lending, None, lent);
        let diff: Vec<usize> = got
            .iter()
            .zip([&dq_d, &dk_d, &dv_d])
            .map(|(g, w)| differing(g, w))
            .collect();
        assert_eq!(diff, [0, 0, 0], "{tag}: too little or no dq_accum lent");
    }

    // A one-pass workspace built for half the batch (at least one sequence fewer) holds no
    // dq_accum for this call: the deterministic backward, bit for bit.
    if s.batch > 1 {
        let half = AttnShape {
            batch: s.batch / 2,
            ..s
        };
        let mut small = AttentionWorkspace::for_flash(st, half, FlashBackward::OnePass).unwrap();
        assert_eq!(
            small.flash_backward_for::<T>(s, false),
            FlashBackward::Deterministic
        );
        let got = p.backward(dev, gemm, &mut small, None, None);
        let diff: Vec<usize> = got
            .iter()
            .zip([&dq_d, &dk_d, &dv_d])
            .map(|(g, w)| differing(g, w))
            .collect();
        assert_eq!(diff, [0, 0, 0], "{tag}: a too-small one-pass workspace");
    }
    // A masked call (a sliding window) runs the mma.sync kernels' deterministic backward
    // whatever the workspace.
    let window = Some(s.seq / 2 + 1);
    let masked = Problem::<T>::new(dev, gemm, s, seed + 1, window);
    let want = masked.backward(dev, gemm, &mut det, window, None);
    let got = masked.backward(dev, gemm, &mut one, window, None);
    let diff: Vec<usize> = got
        .iter()
        .zip(&want)
        .map(|(g, w)| differing(g, w))
        .collect();
    assert_eq!(
        diff,
        [0, 0, 0],
        "{tag}: a masked call through a one-pass workspace"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn one_pass_backward_matches_the_deterministic_backward() {
    const TEST: &str = "one_pass_backward_matches_the_deterministic_backward";
    let Some((_kernels, dev, gemm)) = hopper_or_skip(TEST) else {
        return;
    };
    const BF16_DQ: f64 = 2e-3;
    const F16_DQ: f64 = 1e-3;
    for (i, &(b, t, hq, hkv)) in [
        (1, 130, 2, 1),
        (2, 333, 8, 1),
        (3, 64, 4, 4),
        (2, 1024, 32, 4),
    ]
    .iter()
    .enumerate()
    {
        one_pass_case::<bf16>(
            &dev,
            &gemm,
            shape(b, t, hq, hkv, 64),
            300 + i as u64,
            BF16_DQ,
        );
    }
    one_pass_case::<f16>(&dev, &gemm, shape(2, 257, 4, 2, 64), 400, F16_DQ);
    one_pass_case::<f16>(&dev, &gemm, shape(2, 1024, 32, 4, 64), 401, F16_DQ);
}

/// `0` loads the one-pass backward's query stages (Q, dO) with cp.async; `1` Q and dO with TMA
/// or fails; unset, TMA where the driver encodes the tensor maps.
const BWD_TMA: &str = "TILEARN_FLASH_SM90_BWD_TMA";

/// The one-pass backward with TMA loads against its cp.async loads at one shape: dk and dv the
/// same bits (each CTA's products in a fixed order), dq within `tol_dq` (see the file's
/// documentation). Several batch entries and partial last query blocks check the tensor maps'
/// bounds (queries past seq are zeros, not the next entry's).
fn bwd_tma_case<T: Elem>(dev: &GpuDevice, gemm: &Gemm, s: AttnShape, seed: u64, tol_dq: f64) {
    let st = dev.stream();
    let p = Problem::<T>::new(dev, gemm, s, seed, None);
    let mut one = AttentionWorkspace::for_flash(st, s, FlashBackward::OnePass).unwrap();
    // `1`: TMA or an error, so the comparison cannot pass by measuring the cp.async fallback
    // against itself.
    let [dq_t, dk_t, dv_t] = with_env(BWD_TMA, "1", || p.backward(dev, gemm, &mut one, None, None));
    let [dq_c, dk_c, dv_c] = with_env(BWD_TMA, "0", || p.backward(dev, gemm, &mut one, None, None));
    let tag = format!("{} {s:?}", std::any::type_name::<T>());
    let err = rel_err("dq", &dq_t, &dq_c);
    let kv_diff = [differing(&dk_t, &dk_c), differing(&dv_t, &dv_c)];
    report(&format!(
        "gpu_flash_sm90: {tag}: one-pass backward, TMA against cp.async: dq {err:.2e} (tol \
         {tol_dq:.0e}), dk / dv values differing {kv_diff:?}"
    ));
    assert_eq!(kv_diff, [0, 0], "{tag}: dk / dv differ");
    assert!(err <= tol_dq, "{tag}: dq {err:.2e} > {tol_dq:.0e}");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn the_tma_one_pass_backward_matches_its_cp_async_loads() {
    const TEST: &str = "the_tma_one_pass_backward_matches_its_cp_async_loads";
    let Some((_kernels, dev, gemm)) = hopper_or_skip(TEST) else {
        return;
    };
    for (i, &(b, t, hq, hkv)) in TMA_SHAPES_BF16.iter().enumerate() {
        bwd_tma_case::<bf16>(&dev, &gemm, shape(b, t, hq, hkv, 64), 700 + i as u64, 2e-3);
    }
    let (b, t, hq, hkv) = TMA_SHAPE_F16;
    bwd_tma_case::<f16>(&dev, &gemm, shape(b, t, hq, hkv, 64), 800, 1e-3);
}
