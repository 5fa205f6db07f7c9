//! Fused CUDA optimizers against the CPU optimizers of this crate, over several steps, at an
//! awkward size (1 000 003 elements: not a multiple of the chunk, the vector width or the
//! block), with groups whose ranges leave gaps and start at misaligned elements.
//!
//! Tolerances: fp32 master weights and state ‖gpu − cpu‖/‖cpu‖ ≤ 1e-5 (the GPU bound;
//! the kernels perform the CPU's f32 operations in the same order without FMA contraction, so
//! in practice the results are bit-identical and the tests print how many elements differ).
//! The bf16 / f16 working copy must equal round-to-nearest-even of the GPU's own master weight
//! bit for bit. Elements outside every segment (gaps, other shards) must be untouched bit for
//! bit, and the working copy, poisoned with NaN before the first step, must keep the poison
//! there.
//!
//! `torch_trajectories_replay_on_gpu` replays the PyTorch-recorded trajectories of
//! `tests/optim_golden` (every case, 20 steps) with the fused kernels against torch itself.
//!
//! Without a GPU or driver each GPU test prints `skipped: <reason>` and passes; the plan
//! validation tests run everywhere.
#![cfg(feature = "cuda")]
// Groups take a list of ranges; a list holding a single range is intended here.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use std::io::Write;
use std::ops::Range;
use std::sync::Arc;

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cuda::{CudaSlice, CudaStream, GpuDevice};
use tilearn_optim::cuda::{
    ADAM_GROUP_WORDS, AdamGroupScalars, AdamState, Clip, FusedError, GradNorm, Grads, ParamCopy,
    Rounding, SegmentPlan, StepIo, adam_step, adam_step_device_groups, adamw_step, local_segments,
};
use tilearn_optim::{
    AdamW, AdamWConfig, OptimError, ParamGroup, Segment, clip_grad_norm, validate_groups,
};

const N: usize = 1_000_003;
const TOL: f64 = 1e-5;

/// Writes to the process's stderr directly: libtest captures `eprintln!` of passing tests, and
/// skips and measured errors must be visible in the log.
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

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Uniform in ±[lo, hi): bounded away from zero.
fn nonzero(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let m = rng.random_range(lo..hi);
            if rng.random::<bool>() { m } else { -m }
        })
        .collect()
}

fn upload<T: cudarc::driver::DeviceRepr>(s: &Arc<CudaStream>, host: &[T]) -> CudaSlice<T> {
    s.clone_htod(host).expect("host-to-device copy")
}

fn download<T: cudarc::driver::DeviceRepr>(dev: &GpuDevice, buf: &CudaSlice<T>) -> Vec<T> {
    dev.synchronize().expect("kernels ran without error");
    dev.stream().clone_dtoh(buf).expect("device-to-host copy")
}

/// Two decay ranges and three no-decay ranges with a 5-element gap at the front, ranges
/// starting at elements ≡ 1, 2, 3 (mod 4), and one segment shorter than the vector width.
fn groups() -> Vec<ParamGroup> {
    vec![
        ParamGroup::new(
            "decay",
            vec![5..300_001, 300_010..700_001, 700_003..999_990],
            0.1,
        ),
        ParamGroup::new(
            "no_decay",
            vec![300_001..300_010, 700_001..700_003, 999_990..N],
            0.0,
        )
        .with_lr_scale(0.5),
    ]
}

fn segments_of(groups: &[ParamGroup]) -> Vec<Segment> {
    validate_groups(groups, N).expect("valid groups")
}

/// Mask of the elements some segment covers, restricted to `shard`.
fn covered(segments: &[Segment], shard: &Range<usize>) -> Vec<bool> {
    let mut mask = vec![false; N];
    for s in segments {
        for (i, m) in mask
            .iter_mut()
            .enumerate()
            .take(s.range.end)
            .skip(s.range.start)
        {
            *m = shard.contains(&i);
        }
    }
    mask
}

/// ‖got − want‖/‖want‖ over the masked elements, the number of masked elements whose bits
/// differ, and the number of unmasked elements whose bits differ from `untouched`.
struct Diff {
    rel: f64,
    bits_differ: usize,
    outside_changed: usize,
}

fn diff(got: &[f32], want: &[f32], mask: &[bool], untouched: &[f32]) -> Diff {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    let (mut bits_differ, mut outside_changed) = (0usize, 0usize);
    for i in 0..got.len() {
        if mask[i] {
            assert!(
                got[i].is_finite(),
                "element {i} is {} (want {})",
                got[i],
                want[i]
            );
            let d = f64::from(got[i]) - f64::from(want[i]);
            num += d * d;
            den += f64::from(want[i]) * f64::from(want[i]);
            bits_differ += usize::from(got[i].to_bits() != want[i].to_bits());
        } else {
            outside_changed += usize::from(got[i].to_bits() != untouched[i].to_bits());
        }
    }
    let rel = if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    };
    Diff {
        rel,
        bits_differ,
        outside_changed,
    }
}

fn check(test: &str, what: &str, got: &[f32], want: &[f32], mask: &[bool], untouched: &[f32]) {
    let d = diff(got, want, mask, untouched);
    report(&format!(
        "{test}: {what}: rel err {:.3e} (bound {TOL:e}), {} of {} updated elements differ in \
         bits, {} elements outside the segments changed",
        d.rel,
        d.bits_differ,
        mask.iter().filter(|&&m| m).count(),
        d.outside_changed
    ));
    assert!(
        d.rel <= TOL,
        "{test}: {what}: rel err {:e} > {TOL:e}",
        d.rel
    );
    assert_eq!(
        d.outside_changed, 0,
        "{test}: {what}: elements outside the segments were modified"
    );
}

/// The working copy must be RNE(master) on the masked elements and still the poison elsewhere.
fn check_bf16_copy(test: &str, copy: &[bf16], master: &[f32], mask: &[bool]) {
    let mut wrong = 0usize;
    let mut first = None;
    for i in 0..copy.len() {
        let want = if mask[i] {
            bf16::from_f32(master[i]).to_bits()
        } else {
            POISON_BF16
        };
        if copy[i].to_bits() != want {
            wrong += 1;
            first.get_or_insert(i);
        }
    }
    report(&format!(
        "{test}: bf16 working copy: {wrong} elements differ from bf16(master) / poison"
    ));
    assert_eq!(
        wrong,
        0,
        "{test}: bf16 copy wrong, first at {first:?}: {:?} vs master {:?}",
        first.map(|i| copy[i]),
        first.map(|i| master[i])
    );
}

fn check_f16_copy(test: &str, copy: &[f16], master: &[f32], mask: &[bool]) {
    let wrong = (0..copy.len())
        .filter(|&i| {
            let want = if mask[i] {
                f16::from_f32(master[i]).to_bits()
            } else {
                POISON_F16
            };
            copy[i].to_bits() != want
        })
        .count();
    report(&format!(
        "{test}: f16 working copy: {wrong} elements differ from f16(master) / poison"
    ));
    assert_eq!(wrong, 0, "{test}: f16 copy wrong");
}

/// Quiet NaNs (never a value a step writes).
const POISON_BF16: u16 = 0x7FC1;
const POISON_F16: u16 = 0x7E01;

#[derive(Clone, Copy, PartialEq)]
enum GradKind {
    F32,
    Bf16,
}

#[derive(Clone, Copy, PartialEq)]
enum CopyKind {
    None,
    Bf16,
    F16,
}

/// One Adam-family scenario: GPU steps against the CPU optimizer.
struct AdamCase {
    name: &'static str,
    amsgrad: bool,
    grads: GradKind,
    copy: CopyKind,
    /// Gradients are stored multiplied by `scale` and the kernel gets `inv_scale = 1/scale`.
    scale: Option<f32>,
    /// Global-norm clip to this max norm (computed on the device by GradNorm).
    max_norm: Option<f64>,
    /// The GPU buffers start one element into their allocation (no vector path).
    misaligned: bool,
    shard: Range<usize>,
    steps: usize,
    /// The groups' scalars go in a device table the kernel reads (`adam_step_device_groups`,
    /// what a replayed CUDA graph launches) instead of the kernel's argument.
    device_groups: bool,
}

impl AdamCase {
    fn new(name: &'static str) -> Self {
        AdamCase {
            name,
            amsgrad: false,
            grads: GradKind::Bf16,
            copy: CopyKind::Bf16,
            scale: None,
            max_norm: None,
            misaligned: false,
            shard: 0..N,
            steps: 4,
            device_groups: false,
        }
    }
}

/// Device buffer of `host` (restricted to `shard`), optionally starting one element into a
/// larger allocation; returns the allocation and the offset of the buffer in it.
fn device_buf<T: cudarc::driver::DeviceRepr + Copy>(
    s: &Arc<CudaStream>,
    host: &[T],
    shard: &Range<usize>,
    misaligned: bool,
) -> CudaSlice<T> {
    let mut v = Vec::with_capacity(shard.len() + 1);
    if misaligned {
        v.push(host[shard.start]);
    }
    v.extend_from_slice(&host[shard.clone()]);
    upload(s, &v)
}

fn off(misaligned: bool) -> usize {
    usize::from(misaligned)
}

fn run_adamw_case(dev: &GpuDevice, c: &AdamCase) {
    let s = dev.stream();
    let test = c.name;
    let config = AdamWConfig {
        lr: 1e-3,
        weight_decay: 0.1,
        amsgrad: c.amsgrad,
        ..AdamWConfig::default()
    };
    let groups = groups();
    let segments = segments_of(&groups);
    let mut cpu = AdamW::new(config, groups.clone(), N).expect("cpu adamw");
    let mut r = rng(0xADA3 + c.steps as u64);
    let init = nonzero(&mut r, N, 0.05, 2.0);
    let mut cpu_params = init.clone();

    let shard = c.shard.clone();
    let o = off(c.misaligned);
    let len = shard.len();
    let zeros = vec![0.0f32; N];
    let mut p_dev = device_buf(s, &init, &shard, c.misaligned);
    let mut m_dev = device_buf(s, &zeros, &shard, c.misaligned);
    let mut v_dev = device_buf(s, &zeros, &shard, c.misaligned);
    let mut x_dev = device_buf(s, &zeros, &shard, c.misaligned);
    let mut copy_bf16 = device_buf(
        s,
        &vec![bf16::from_bits(POISON_BF16); N],
        &shard,
        c.misaligned,
    );
    let mut copy_f16 = device_buf(
        s,
        &vec![f16::from_bits(POISON_F16); N],
        &shard,
        c.misaligned,
    );
    let mut norm = GradNorm::new(s).expect("norm scratch");
    let inv_scale_dev = c.scale.map(|sc| upload(s, &[1.0 / sc]));
    let found_inf_dev = upload(s, &[0.0f32]);
    let plan = SegmentPlan::new(s, &segments, N, shard.clone(), groups.len()).expect("plan");

    for step in 0..c.steps {
        let lr = 1e-3 * (1.0 + step as f32) / 2.0;
        // Gradients as the kernel reads them (bf16 or f32, times the loss scale), and as the
        // CPU gets them: the same values, unscaled by one f32 multiply, then clipped.
        let g = nonzero(&mut r, N, 1e-3, 1.0);
        let g_stored_f32: Vec<f32> = match c.grads {
            GradKind::F32 => g.iter().map(|&x| x * c.scale.unwrap_or(1.0)).collect(),
            GradKind::Bf16 => g
                .iter()
                .map(|&x| bf16::from_f32(x * c.scale.unwrap_or(1.0)).to_f32())
                .collect(),
        };
        let mut g_cpu: Vec<f32> = match c.scale {
            Some(sc) => g_stored_f32.iter().map(|&x| x * (1.0 / sc)).collect(),
            None => g_stored_f32.clone(),
        };
        if let Some(max_norm) = c.max_norm {
            clip_grad_norm(&mut g_cpu, max_norm);
        }
        let scalars: Vec<_> = (0..groups.len())
            .map(|gi| cpu.step_scalars(gi, lr).expect("group"))
            .collect();
        cpu.step(&mut cpu_params, &g_cpu, lr).expect("cpu step");

        let g_f32_dev;
        let g_bf16_dev;
        let grads = match c.grads {
            GradKind::F32 => {
                g_f32_dev = device_buf(s, &g_stored_f32, &shard, c.misaligned);
                Grads::F32(g_f32_dev.slice(o..o + len))
            }
            GradKind::Bf16 => {
                let h: Vec<bf16> = g_stored_f32.iter().map(|&x| bf16::from_f32(x)).collect();
                g_bf16_dev = device_buf(s, &h, &shard, c.misaligned);
                Grads::Bf16(g_bf16_dev.slice(o..o + len))
            }
        };
        // The norm is the global one: over the whole gradient buffer (a ZeRO caller would
        // all-reduce the shards' sums); here the shard tests clip only over the whole buffer.
        let full_grads_dev;
        if c.max_norm.is_some() {
            let norm_grads = if shard == (0..N) {
                match &grads {
                    Grads::F32(v) => Grads::F32(v.slice(..)),
                    Grads::Bf16(v) => Grads::Bf16(v.slice(..)),
                }
            } else {
                full_grads_dev = upload(
                    s,
                    &g_stored_f32
                        .iter()
                        .map(|&x| bf16::from_f32(x))
                        .collect::<Vec<_>>(),
                );
                Grads::Bf16(full_grads_dev.as_view())
            };
            let scale_view = inv_scale_dev.as_ref().map(|x| x.as_view());
            norm.compute(s, &norm_grads, scale_view.as_ref())
                .expect("norm");
        }
        let param_copy = match c.copy {
            CopyKind::None => ParamCopy::None,
            CopyKind::Bf16 => ParamCopy::Bf16(copy_bf16.slice_mut(o..o + len), Rounding::Nearest),
            CopyKind::F16 => ParamCopy::F16(copy_f16.slice_mut(o..o + len)),
        };
        let io = StepIo {
            grads,
            param_copy,
            inv_scale: inv_scale_dev.as_ref().map(|x| x.as_view()),
            found_inf: Some(found_inf_dev.as_view()),
            clip: c.max_norm.map(|max_norm| Clip {
                grad_sumsq: norm.result(),
                max_norm,
            }),
            step: step as u64 + 1,
        };
        let state = AdamState {
            params: p_dev.slice_mut(o..o + len),
            exp_avg: m_dev.slice_mut(o..o + len),
            exp_avg_sq: v_dev.slice_mut(o..o + len),
            max_exp_avg_sq: if c.amsgrad {
                Some(x_dev.slice_mut(o..o + len))
            } else {
                None
            },
        };
        if c.device_groups {
            let words: Vec<u32> = scalars
                .iter()
                .flat_map(|x| AdamGroupScalars::from(x).to_words().expect("valid scalars"))
                .collect();
            assert_eq!(words.len(), groups.len() * ADAM_GROUP_WORDS);
            let table = upload(s, &words);
            adam_step_device_groups(s, &plan, &table, state, io).expect("fused step");
        } else {
            adamw_step(s, &plan, &scalars, state, io).expect("fused step");
        }
    }

    // Back to global indexing (elements outside the shard keep their initial values).
    let widen = |buf: &CudaSlice<f32>, base: &[f32]| -> Vec<f32> {
        let host = download(dev, buf);
        let mut full = base.to_vec();
        full[shard.clone()].copy_from_slice(&host[o..o + len]);
        full
    };
    let mask = covered(&segments, &shard);
    let gpu_p = widen(&p_dev, &init);
    check(test, "params", &gpu_p, &cpu_params, &mask, &init);
    check(
        test,
        "exp_avg",
        &widen(&m_dev, &zeros),
        cpu.exp_avg(),
        &mask,
        &zeros,
    );
    check(
        test,
        "exp_avg_sq",
        &widen(&v_dev, &zeros),
        cpu.exp_avg_sq(),
        &mask,
        &zeros,
    );
    if c.amsgrad {
        let want = cpu.max_exp_avg_sq().expect("amsgrad state");
        check(
            test,
            "max_exp_avg_sq",
            &widen(&x_dev, &zeros),
            want,
            &mask,
            &zeros,
        );
    }
    match c.copy {
        CopyKind::None => {}
        CopyKind::Bf16 => {
            let host = download(dev, &copy_bf16);
            let mut full = vec![bf16::from_bits(POISON_BF16); N];
            full[shard.clone()].copy_from_slice(&host[o..o + len]);
            check_bf16_copy(test, &full, &gpu_p, &mask);
        }
        CopyKind::F16 => {
            let host = download(dev, &copy_f16);
            let mut full = vec![f16::from_bits(POISON_F16); N];
            full[shard.clone()].copy_from_slice(&host[o..o + len]);
            check_f16_copy(test, &full, &gpu_p, &mask);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn adamw_bf16_grads_bf16_copy_matches_cpu() {
    let Some(dev) = gpu_or_skip("adamw_bf16_grads_bf16_copy_matches_cpu") else {
        return;
    };
    run_adamw_case(&dev, &AdamCase::new("adamw_bf16_grads_bf16_copy"));
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn adamw_amsgrad_f32_grads_f16_copy_matches_cpu() {
    let Some(dev) = gpu_or_skip("adamw_amsgrad_f32_grads_f16_copy_matches_cpu") else {
        return;
    };
    let mut c = AdamCase::new("adamw_amsgrad_f32_grads_f16_copy");
    c.amsgrad = true;
    c.grads = GradKind::F32;
    c.copy = CopyKind::F16;
    run_adamw_case(&dev, &c);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn adamw_misaligned_buffers_take_the_scalar_path_and_match_cpu() {
    let Some(dev) = gpu_or_skip("adamw_misaligned_buffers_take_the_scalar_path_and_match_cpu")
    else {
        return;
    };
    let mut c = AdamCase::new("adamw_misaligned");
    c.misaligned = true;
    c.amsgrad = true;
    run_adamw_case(&dev, &c);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn adamw_inv_scale_is_applied_inside_the_kernel() {
    let Some(dev) = gpu_or_skip("adamw_inv_scale_is_applied_inside_the_kernel") else {
        return;
    };
    let mut c = AdamCase::new("adamw_inv_scale");
    c.scale = Some(1024.0);
    run_adamw_case(&dev, &c);
    let mut c = AdamCase::new("adamw_inv_scale_f32_grads_no_copy");
    // Not a power of two: the unscale multiply rounds, and must round as the CPU's.
    c.scale = Some(3000.0);
    c.grads = GradKind::F32;
    c.copy = CopyKind::None;
    run_adamw_case(&dev, &c);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn adamw_global_norm_clip_is_fused() {
    let Some(dev) = gpu_or_skip("adamw_global_norm_clip_is_fused") else {
        return;
    };
    // The gradient norm of 1e6 elements uniform in ±[1e-3, 1) is about 577: max_norm 1 clips
    // every step; with a loss scale the norm must be of the unscaled gradients.
    let mut c = AdamCase::new("adamw_clip");
    c.max_norm = Some(1.0);
    run_adamw_case(&dev, &c);
    let mut c = AdamCase::new("adamw_clip_with_inv_scale");
    c.max_norm = Some(1.0);
    c.scale = Some(512.0);
    run_adamw_case(&dev, &c);
    // max_norm above the norm: no clipping (coefficient must not be applied).
    let mut c = AdamCase::new("adamw_clip_not_triggered");
    c.max_norm = Some(1e6);
    run_adamw_case(&dev, &c);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn adamw_with_device_group_table_matches_cpu() {
    let Some(dev) = gpu_or_skip("adamw_with_device_group_table_matches_cpu") else {
        return;
    };
    // The learning rate changes every step (run_adamw_case's schedule) and the table is
    // rewritten for each: the same bounds as the argument path, with clipping and a bf16 copy,
    // and with amsgrad, f32 gradients and an f16 copy.
    let mut c = AdamCase::new("adamw_device_groups_clip");
    c.device_groups = true;
    c.max_norm = Some(1.0);
    run_adamw_case(&dev, &c);
    let mut c = AdamCase::new("adamw_device_groups_amsgrad_f16_copy");
    c.device_groups = true;
    c.amsgrad = true;
    c.grads = GradKind::F32;
    c.copy = CopyKind::F16;
    run_adamw_case(&dev, &c);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn adamw_zero1_shards_update_only_their_range() {
    let Some(dev) = gpu_or_skip("adamw_zero1_shards_update_only_their_range") else {
        return;
    };
    // A misaligned shard cutting through a decay range, and an aligned one cutting the short
    // no-decay ranges; buffers hold the shard only (ZeRO-1 layout).
    for (name, shard) in [
        ("adamw_shard_250001_800002", 250_001..800_002),
        ("adamw_shard_300004_N", 300_004..N),
    ] {
        let mut c = AdamCase::new(name);
        c.shard = shard;
        c.amsgrad = true;
        c.max_norm = Some(2.0);
        run_adamw_case(&dev, &c);
    }
}

/// Host snapshot of every buffer of an AdamW step.
fn snapshot(dev: &GpuDevice, bufs: &[&CudaSlice<f32>], copy: &CudaSlice<bf16>) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = bufs
        .iter()
        .map(|b| download(dev, b).iter().map(|x| x.to_bits()).collect())
        .collect();
    out.push(
        download(dev, copy)
            .iter()
            .map(|x| u32::from(x.to_bits()))
            .collect(),
    );
    out
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn adamw_found_inf_skips_the_step_bit_identically() {
    let test = "adamw_found_inf_skips_the_step_bit_identically";
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let groups = groups();
    let segments = segments_of(&groups);
    let config = AdamWConfig {
        amsgrad: true,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let cpu = AdamW::new(config, groups.clone(), N).expect("cpu");
    let mut r = rng(77);
    let mut p = upload(s, &nonzero(&mut r, N, 0.05, 2.0));
    let mut m = upload(s, &nonzero(&mut r, N, 0.01, 0.1));
    let mut v = upload(s, &nonzero(&mut r, N, 0.01, 0.1));
    let mut x = upload(s, &nonzero(&mut r, N, 0.01, 0.1));
    let mut copy = upload(s, &vec![bf16::from_bits(POISON_BF16); N]);
    let g: Vec<bf16> = nonzero(&mut r, N, 1e-3, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let g = upload(s, &g);
    let plan = SegmentPlan::whole(s, &segments, N, groups.len()).expect("plan");
    let scalars: Vec<_> = (0..groups.len())
        .map(|gi| cpu.step_scalars(gi, 1e-3).expect("group"))
        .collect();
    let before = snapshot(&dev, &[&p, &m, &v, &x], &copy);
    // 1.0 (what torch writes), +inf and NaN all mean "skip".
    for flag in [1.0f32, f32::INFINITY, f32::NAN] {
        let found_inf = upload(s, &[flag]);
        let io = StepIo {
            grads: Grads::Bf16(g.as_view()),
            param_copy: ParamCopy::Bf16(copy.as_view_mut(), Rounding::Nearest),
            inv_scale: None,
            found_inf: Some(found_inf.as_view()),
            clip: None,
            step: 1,
        };
        let state = AdamState {
            params: p.as_view_mut(),
            exp_avg: m.as_view_mut(),
            exp_avg_sq: v.as_view_mut(),
            max_exp_avg_sq: Some(x.as_view_mut()),
        };
        adamw_step(s, &plan, &scalars, state, io).expect("launch");
        let after = snapshot(&dev, &[&p, &m, &v, &x], &copy);
        let changed: usize = before
            .iter()
            .zip(&after)
            .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count())
            .sum();
        report(&format!(
            "{test}: found_inf = {flag}: {changed} elements changed"
        ));
        assert_eq!(changed, 0, "{test}: found_inf = {flag} must skip the step");
    }
    // found_inf = 0: the step runs (the flag is read, not just any non-null pointer skips).
    let found_inf = upload(s, &[0.0f32]);
    let io = StepIo {
        grads: Grads::Bf16(g.as_view()),
        param_copy: ParamCopy::Bf16(copy.as_view_mut(), Rounding::Nearest),
        inv_scale: None,
        found_inf: Some(found_inf.as_view()),
        clip: None,
        step: 1,
    };
    let state = AdamState {
        params: p.as_view_mut(),
        exp_avg: m.as_view_mut(),
        exp_avg_sq: v.as_view_mut(),
        max_exp_avg_sq: Some(x.as_view_mut()),
    };
    adamw_step(s, &plan, &scalars, state, io).expect("launch");
    let after = snapshot(&dev, &[&p, &m, &v, &x], &copy);
    let changed = before[0]
        .iter()
        .zip(&after[0])
        .filter(|(a, b)| a != b)
        .count();
    report(&format!("{test}: found_inf = 0: {changed} params changed"));
    assert!(
        changed > N / 2,
        "{test}: found_inf = 0 must run the step ({changed} params changed)"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn bf16_stochastic_rounding_brackets_the_master_and_is_unbiased() {
    let test = "bf16_stochastic_rounding_brackets_the_master_and_is_unbiased";
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let groups = vec![ParamGroup::whole("all", N, 0.0)];
    let segments = segments_of(&groups);
    let cpu = AdamW::new(AdamWConfig::default(), groups.clone(), N).expect("cpu");
    let scalars: Vec<_> = vec![cpu.step_scalars(0, 1e-3).expect("group")];
    let plan = SegmentPlan::whole(s, &segments, N, 1).expect("plan");
    let mut r = rng(5);
    let p = upload(s, &nonzero(&mut r, N, 0.05, 2.0));
    let m = upload(s, &vec![0.0f32; N]);
    let v = upload(s, &vec![0.0f32; N]);
    let g: Vec<f32> = nonzero(&mut r, N, 1e-3, 1.0);
    let g = upload(s, &g);
    let mut outs = Vec::new();
    for seed in [11u64, 11, 12] {
        // The same master and step each time: restore p, m, v.
        let mut pc = s.clone_dtod(&p).expect("copy");
        let mut mc = s.clone_dtod(&m).expect("copy");
        let mut vc = s.clone_dtod(&v).expect("copy");
        let mut copy = upload(s, &vec![bf16::from_bits(POISON_BF16); N]);
        let io = StepIo {
            grads: Grads::F32(g.as_view()),
            param_copy: ParamCopy::Bf16(copy.as_view_mut(), Rounding::Stochastic { seed }),
            inv_scale: None,
            found_inf: None,
            clip: None,
            step: 1,
        };
        let state = AdamState {
            params: pc.as_view_mut(),
            exp_avg: mc.as_view_mut(),
            exp_avg_sq: vc.as_view_mut(),
            max_exp_avg_sq: None,
        };
        adamw_step(s, &plan, &scalars, state, io).expect("launch");
        outs.push((download(&dev, &pc), download(&dev, &copy)));
    }

    let (master, copy) = &outs[0];
    let (mut outside, mut up, mut expected_up, mut var) = (0usize, 0.0f64, 0.0f64, 0.0f64);
    for (&x, &c) in master.iter().zip(copy) {
        // The two bf16 values around x: truncation toward zero and the next one away from zero.
        let down = bf16::from_bits((x.to_bits() >> 16) as u16);
        let frac = f64::from(x.to_bits() & 0xFFFF) / 65536.0;
        let away = bf16::from_bits(down.to_bits() + 1);
        if c == down {
            // counted as "down"
        } else if c == away {
            up += 1.0;
        } else {
            outside += 1;
        }
        expected_up += frac;
        var += frac * (1.0 - frac);
    }
    let z = (up - expected_up) / var.sqrt();
    let same_seed_differs = outs[0]
        .1
        .iter()
        .zip(&outs[1].1)
        .filter(|(a, b)| a != b)
        .count();
    let other_seed_differs = outs[0]
        .1
        .iter()
        .zip(&outs[2].1)
        .filter(|(a, b)| a != b)
        .count();
    report(&format!(
        "{test}: {outside} copies outside the bracket; rounded away {up} times, expected \
         {expected_up:.1} (z = {z:.2}); same seed: {same_seed_differs} differ, other seed: \
         {other_seed_differs} differ"
    ));
    assert_eq!(
        outside, 0,
        "{test}: SR result not one of the two neighbours"
    );
    assert!(z.abs() < 6.0, "{test}: SR biased, z = {z}");
    assert_eq!(same_seed_differs, 0, "{test}: SR not reproducible");
    assert!(
        other_seed_differs > N / 10,
        "{test}: the seed has no effect"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn grad_norm_matches_the_cpu_sum_of_squares_and_is_deterministic() {
    let test = "grad_norm_matches_the_cpu_sum_of_squares_and_is_deterministic";
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let mut r = rng(9);
    let mut norm = GradNorm::new(s).expect("scratch");
    for (n, scale) in [(N, None), (N, Some(0.125f32)), (1, None), (4099, Some(3.0))] {
        let g = nonzero(&mut r, n, 1e-4, 3.0);
        let g16: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
        let scale_dev = scale.map(|sc| upload(s, &[sc]));
        for bf in [false, true] {
            let host: Vec<f32> = if bf {
                g16.iter()
                    .map(|x| x.to_f32() * scale.unwrap_or(1.0))
                    .collect()
            } else {
                g.iter().map(|&x| x * scale.unwrap_or(1.0)).collect()
            };
            let want = tilearn_optim::clip::sum_of_squares(&host);
            let g32_dev = upload(s, &g);
            let g16_dev = upload(s, &g16);
            let grads = if bf {
                Grads::Bf16(g16_dev.as_view())
            } else {
                Grads::F32(g32_dev.as_view())
            };
            let sv = scale_dev.as_ref().map(|x| x.as_view());
            norm.compute(s, &grads, sv.as_ref()).expect("norm");
            let first = norm.read(s).expect("read");
            norm.compute(s, &grads, sv.as_ref()).expect("norm");
            let second = norm.read(s).expect("read");
            let rel = (first[0] - want).abs() / want;
            report(&format!(
                "{test}: n = {n}, bf16 = {bf}, inv_scale = {scale:?}: sumsq {} vs cpu {want} \
                 (rel {rel:.2e}), norm {}",
                first[0], first[1]
            ));
            assert!(rel <= 1e-12, "{test}: sum of squares rel err {rel:e}");
            assert_eq!(
                first[1].to_bits(),
                first[0].sqrt().to_bits(),
                "{test}: norm"
            );
            assert_eq!(
                first[0].to_bits(),
                second[0].to_bits(),
                "{test}: not deterministic"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn fused_step_rejects_bad_input_before_launching() {
    let test = "fused_step_rejects_bad_input_before_launching";
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let n = 1000usize;
    let groups = vec![ParamGroup::new("a", vec![3..900], 0.1)];
    let segments = validate_groups(&groups, n).expect("groups");
    let plan = SegmentPlan::whole(s, &segments, n, 1).expect("plan");
    let cpu = AdamW::new(AdamWConfig::default(), groups, n).expect("cpu");
    let good = AdamGroupScalars::from(&cpu.step_scalars(0, 1e-3).expect("group"));
    let mut r = rng(3);
    let init = nonzero(&mut r, n, 0.05, 2.0);
    let mut p = upload(s, &init);
    let mut m = upload(s, &vec![0.0f32; n]);
    let mut v = upload(s, &vec![0.0f32; n]);
    let g = upload(s, &nonzero(&mut r, n + 1, 0.01, 1.0));

    let mut attempt = |groups: &[AdamGroupScalars], grad_len: usize| -> Result<(), FusedError> {
        let io = StepIo::new(Grads::F32(g.slice(..grad_len)));
        let state = AdamState {
            params: p.as_view_mut(),
            exp_avg: m.as_view_mut(),
            exp_avg_sq: v.as_view_mut(),
            max_exp_avg_sq: None,
        };
        adam_step(s, &plan, groups, state, io)
    };
    let e = attempt(&[good], n + 1).expect_err("grads too long");
    report(&format!("{test}: grads of n+1: {e}"));
    assert!(matches!(
        e,
        FusedError::Optim(OptimError::LengthMismatch { .. })
    ));
    let e = attempt(&[good, good], n).expect_err("two groups for a one-group plan");
    report(&format!("{test}: 2 group scalars: {e}"));
    assert!(matches!(e, FusedError::InvalidArgument { .. }));
    let bad_lr = AdamGroupScalars {
        neg_step_size: f32::NAN,
        ..good
    };
    let e = attempt(&[bad_lr], n).expect_err("NaN lr");
    report(&format!("{test}: NaN step size: {e}"));
    assert!(matches!(
        e,
        FusedError::Optim(OptimError::InvalidHyperParameter { .. })
    ));
    let bad_beta = AdamGroupScalars { beta2: 1.0, ..good };
    let e = attempt(&[bad_beta], n).expect_err("beta2 = 1");
    report(&format!("{test}: beta2 = 1: {e}"));
    assert!(matches!(
        e,
        FusedError::Optim(OptimError::InvalidHyperParameter { .. })
    ));
    let bad_beta1 = AdamGroupScalars {
        one_minus_beta1: 1.5,
        ..good
    };
    assert!(attempt(&[bad_beta1], n).is_err(), "beta1 = -0.5 accepted");
    let after = download(&dev, &p);
    assert!(
        after
            .iter()
            .zip(&init)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{test}: a rejected step modified the parameters"
    );
    let e = SegmentPlan::new(s, &segments, n, 500..1001, 1).expect_err("shard past the end");
    report(&format!("{test}: shard 500..1001 of 1000: {e}"));
    assert!(matches!(
        e,
        FusedError::Optim(OptimError::RangeOutOfBounds { .. })
    ));
}

// ---- plan construction: host only, runs without a GPU ----

fn seg(group: usize, range: Range<usize>) -> Segment {
    Segment { group, range }
}

#[test]
fn plan_cuts_segments_into_chunks_and_restricts_them_to_the_shard() {
    use tilearn_optim::cuda::CHUNK;
    let segments = vec![
        seg(0, 3..3 + CHUNK + 1),
        seg(1, 3 + CHUNK + 1..3 + CHUNK + 10),
        seg(0, 40_000..100_000),
    ];
    let (local, chunks) = local_segments(&segments, 100_003, 0..100_003, 2).expect("valid");
    assert_eq!(local.len(), 3);
    assert_eq!(
        local.iter().map(|l| l.chunk_begin).collect::<Vec<_>>(),
        vec![0, 2, 3]
    );
    assert_eq!(chunks, 3 + 60_000usize.div_ceil(CHUNK));
    // A shard inside the third segment and the tail of the first: local indices.
    let (local, chunks) = local_segments(&segments, 100_003, 10..50_000, 2).expect("valid");
    assert_eq!(local[0].range, 0..(3 + CHUNK + 1 - 10));
    assert_eq!(local[1].group, 1);
    assert_eq!(local[2].range, (40_000 - 10)..(50_000 - 10));
    // The first segment shrinks below one chunk: one chunk per segment.
    assert_eq!(chunks, 3);
    // A shard in a gap has no work.
    let (local, chunks) = local_segments(&segments, 100_003, 30_000..40_000, 2).expect("ok");
    assert!(local.is_empty() && chunks == 0);
}

#[test]
fn plan_rejects_bad_shards_groups_and_segment_lists() {
    let segments = vec![seg(0, 0..10), seg(1, 10..20)];
    let e = local_segments(&segments, 20, 5..21, 2).expect_err("shard past the end");
    assert!(matches!(
        e,
        FusedError::Optim(OptimError::RangeOutOfBounds { .. })
    ));
    #[allow(clippy::reversed_empty_ranges)] // the point of the test
    let reversed = 15..5;
    assert!(local_segments(&segments, 20, reversed, 2).is_err());
    let e = local_segments(&segments, 20, 0..20, 1).expect_err("group 1 of 1");
    assert!(matches!(e, FusedError::InvalidArgument { .. }));
    assert!(local_segments(&segments, 20, 0..20, 0).is_err(), "0 groups");
    assert!(
        local_segments(&segments, 20, 0..20, 17).is_err(),
        "17 groups"
    );
    let unsorted = vec![seg(0, 10..20), seg(1, 0..10)];
    assert!(local_segments(&unsorted, 20, 0..20, 2).is_err(), "unsorted");
    let overlapping = vec![seg(0, 0..11), seg(1, 10..20)];
    assert!(
        local_segments(&overlapping, 20, 0..20, 2).is_err(),
        "overlap"
    );
    let outside = vec![seg(0, 0..21)];
    assert!(
        local_segments(&outside, 20, 0..20, 1).is_err(),
        "past numel"
    );
}

// ---- Adam (L2), SGD, Lion: the same fixture, bf16 gradients and a bf16 working copy ----

/// Parameters, a poisoned bf16 copy and the plan over `groups()`, plus per-step gradients.
struct Fixture {
    segments: Vec<Segment>,
    plan: SegmentPlan,
    init: Vec<f32>,
    params: CudaSlice<f32>,
    copy: CudaSlice<bf16>,
    rng: ChaCha8Rng,
}

impl Fixture {
    fn new(dev: &GpuDevice, seed: u64) -> Self {
        let s = dev.stream();
        let groups = groups();
        let segments = segments_of(&groups);
        let plan = SegmentPlan::whole(s, &segments, N, groups.len()).expect("plan");
        let mut rng = rng(seed);
        let init = nonzero(&mut rng, N, 0.05, 2.0);
        Fixture {
            params: upload(s, &init),
            copy: upload(s, &vec![bf16::from_bits(POISON_BF16); N]),
            segments,
            plan,
            init,
            rng,
        }
    }

    /// Next step's gradients: bf16 on the device, the same values as f32 for the CPU.
    fn grads(&mut self, s: &Arc<CudaStream>) -> (Vec<f32>, CudaSlice<bf16>) {
        let g16: Vec<bf16> = nonzero(&mut self.rng, N, 1e-3, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        (g16.iter().map(|x| x.to_f32()).collect(), upload(s, &g16))
    }

    /// Compares params (and the copy) with the CPU's; returns the GPU params.
    fn check_params(&self, dev: &GpuDevice, test: &str, cpu_params: &[f32]) {
        let mask = covered(&self.segments, &(0..N));
        let gpu = download(dev, &self.params);
        check(test, "params", &gpu, cpu_params, &mask, &self.init);
        check_bf16_copy(test, &download(dev, &self.copy), &gpu, &mask);
    }
}

fn io<'a>(g: &'a CudaSlice<bf16>, copy: &'a mut CudaSlice<bf16>, step: u64) -> StepIo<'a> {
    StepIo {
        grads: Grads::Bf16(g.as_view()),
        param_copy: ParamCopy::Bf16(copy.as_view_mut(), Rounding::Nearest),
        inv_scale: None,
        found_inf: None,
        clip: None,
        step,
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn adam_l2_matches_cpu() {
    use tilearn_optim::cuda::adam_l2_step;
    use tilearn_optim::{Adam, AdamConfig};
    let test = "adam_l2_matches_cpu";
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    for amsgrad in [false, true] {
        let mut f = Fixture::new(&dev, 21);
        let config = AdamConfig {
            amsgrad,
            weight_decay: 0.05,
            ..AdamConfig::default()
        };
        let mut cpu = Adam::new(config, groups(), N).expect("cpu");
        let mut cpu_p = f.init.clone();
        let mut m = upload(s, &vec![0.0f32; N]);
        let mut v = upload(s, &vec![0.0f32; N]);
        let mut x = upload(s, &vec![0.0f32; N]);
        for step in 1..=4u64 {
            let lr = 1e-3 / step as f32;
            let (g, g_dev) = f.grads(s);
            let scalars: Vec<_> = (0..2)
                .map(|gi| cpu.step_scalars(gi, lr).expect("g"))
                .collect();
            cpu.step(&mut cpu_p, &g, lr).expect("cpu step");
            let state = AdamState {
                params: f.params.as_view_mut(),
                exp_avg: m.as_view_mut(),
                exp_avg_sq: v.as_view_mut(),
                max_exp_avg_sq: amsgrad.then(|| x.as_view_mut()),
            };
            adam_l2_step(s, &f.plan, &scalars, state, io(&g_dev, &mut f.copy, step))
                .expect("fused step");
        }
        let name = if amsgrad {
            "adam_l2_amsgrad"
        } else {
            "adam_l2"
        };
        f.check_params(&dev, name, &cpu_p);
        let mask = covered(&f.segments, &(0..N));
        let zeros = vec![0.0f32; N];
        check(
            name,
            "exp_avg",
            &download(&dev, &m),
            cpu.exp_avg(),
            &mask,
            &zeros,
        );
        check(
            name,
            "exp_avg_sq",
            &download(&dev, &v),
            cpu.exp_avg_sq(),
            &mask,
            &zeros,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn sgd_matches_cpu_for_momentum_dampening_nesterov_and_plain() {
    use tilearn_optim::cuda::sgd_step;
    use tilearn_optim::{Sgd, SgdConfig};
    let test = "sgd_matches_cpu";
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let configs = [
        ("sgd_momentum_dampening", 0.9, 0.1, false, 0.01),
        ("sgd_nesterov", 0.9, 0.0, true, 0.01),
        ("sgd_plain", 0.0, 0.0, false, 0.0),
    ];
    for (name, momentum, dampening, nesterov, wd) in configs {
        let mut f = Fixture::new(&dev, 31);
        let config = SgdConfig {
            lr: 0.01,
            momentum,
            dampening,
            nesterov,
            weight_decay: wd,
        };
        let mut cpu = Sgd::new(config, groups(), N).expect("cpu");
        let mut cpu_p = f.init.clone();
        // Poisoned: the first step must write the buffer without reading it (buf = g).
        let mut buf = upload(s, &vec![f32::NAN; N]);
        for step in 1..=4u64 {
            let lr = 0.01 / step as f32;
            let (g, g_dev) = f.grads(s);
            let scalars: Vec<_> = (0..2)
                .map(|gi| cpu.step_scalars(gi, lr).expect("g"))
                .collect();
            cpu.step(&mut cpu_p, &g, lr).expect("cpu step");
            let b = (momentum != 0.0).then(|| buf.as_view_mut());
            sgd_step(
                s,
                &f.plan,
                &scalars,
                f.params.as_view_mut(),
                b,
                io(&g_dev, &mut f.copy, step),
            )
            .expect("fused step");
        }
        f.check_params(&dev, name, &cpu_p);
        if momentum != 0.0 {
            let mask = covered(&f.segments, &(0..N));
            let nan = vec![f32::NAN; N];
            check(
                name,
                "momentum_buffer",
                &download(&dev, &buf),
                cpu.momentum_buffer().expect("buffer"),
                &mask,
                &nan,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn lion_matches_cpu() {
    use tilearn_optim::cuda::lion_step;
    use tilearn_optim::{Lion, LionConfig};
    let test = "lion_matches_cpu";
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let mut f = Fixture::new(&dev, 41);
    let config = LionConfig {
        weight_decay: 0.1,
        ..LionConfig::default()
    };
    let mut cpu = Lion::new(config, groups(), N).expect("cpu");
    let mut cpu_p = f.init.clone();
    let mut m = upload(s, &vec![0.0f32; N]);
    for step in 1..=4u64 {
        let lr = 1e-4 * step as f32;
        let (g, g_dev) = f.grads(s);
        let scalars: Vec<_> = (0..2)
            .map(|gi| cpu.step_scalars(gi, lr).expect("g"))
            .collect();
        cpu.step(&mut cpu_p, &g, lr).expect("cpu step");
        lion_step(
            s,
            &f.plan,
            &scalars,
            f.params.as_view_mut(),
            m.as_view_mut(),
            io(&g_dev, &mut f.copy, step),
        )
        .expect("fused step");
    }
    f.check_params(&dev, test, &cpu_p);
    let mask = covered(&f.segments, &(0..N));
    let zeros = vec![0.0f32; N];
    check(
        test,
        "exp_avg",
        &download(&dev, &m),
        cpu.exp_avg(),
        &mask,
        &zeros,
    );
}

// ---- LAMB: per-tensor trust ratios, Apex clip divisor on the host or on the device ----

/// Trust-ratio tensors: every group range cut into pieces of at most 150 001 elements, plus
/// the 5-element gap as a frozen tensor.
fn lamb_tensors() -> Vec<Range<usize>> {
    let mut out = vec![0..5];
    for seg in segments_of(&groups()) {
        let mut start = seg.range.start;
        while start < seg.range.end {
            let end = (start + 150_001).min(seg.range.end);
            out.push(start..end);
            start = end;
        }
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn lamb_matches_cpu_with_host_and_device_clip() {
    use tilearn_optim::cuda::{
        LambScratch, LambState, lamb_groups, lamb_max_norm, lamb_segments, lamb_step,
    };
    use tilearn_optim::{Lamb, LambConfig};
    let test = "lamb_matches_cpu";
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    for device_clip in [false, true] {
        let name = if device_clip {
            "lamb_device_clip"
        } else {
            "lamb_host_clip"
        };
        let mut f = Fixture::new(&dev, 51);
        let mut cpu =
            Lamb::new(LambConfig::default(), groups(), N, lamb_tensors()).expect("cpu lamb");
        let plan = SegmentPlan::whole(s, &lamb_segments(&cpu), N, 2).expect("plan");
        let mut scratch = LambScratch::new(s, &plan).expect("scratch");
        let mut norm = GradNorm::new(s).expect("norm");
        let mut cpu_p = f.init.clone();
        let mut m = upload(s, &vec![0.0f32; N]);
        let mut v = upload(s, &vec![0.0f32; N]);
        for step in 1..=4u64 {
            let lr = 1e-3 * step as f32;
            let (g, g_dev) = f.grads(s);
            let gnorm = cpu.global_grad_norm(&g).expect("norm");
            let groups = lamb_groups(&cpu, lr, gnorm);
            cpu.step(&mut cpu_p, &g, lr).expect("cpu step");
            let mut io = io(&g_dev, &mut f.copy, step);
            if device_clip {
                // Apex's norm covers the group elements only: skip the 5-element gap.
                norm.compute(s, &Grads::Bf16(g_dev.slice(5..)), None)
                    .expect("norm");
                io.clip = Some(Clip {
                    grad_sumsq: norm.result(),
                    max_norm: lamb_max_norm(&cpu).expect("max_grad_norm"),
                });
            }
            let state = LambState {
                params: f.params.as_view_mut(),
                exp_avg: m.as_view_mut(),
                exp_avg_sq: v.as_view_mut(),
            };
            lamb_step(s, &plan, &groups, &mut scratch, state, io).expect("fused step");
        }
        f.check_params(&dev, name, &cpu_p);
        let mask = covered(&f.segments, &(0..N));
        let zeros = vec![0.0f32; N];
        check(
            name,
            "exp_avg",
            &download(&dev, &m),
            cpu.exp_avg(),
            &mask,
            &zeros,
        );
        check(
            name,
            "exp_avg_sq",
            &download(&dev, &v),
            cpu.exp_avg_sq(),
            &mask,
            &zeros,
        );
        let ratios = download(&dev, scratch.ratios());
        let want = cpu.last_ratios();
        let worst = ratios
            .iter()
            .zip(want)
            .map(|(&a, &b)| (f64::from(a) - f64::from(b)).abs() / f64::from(b).abs())
            .fold(0.0f64, f64::max);
        report(&format!(
            "{name}: {} tensors, trust ratios max rel err {worst:.3e}",
            want.len()
        ));
        assert_eq!(ratios.len(), want.len(), "{name}: one ratio per tensor");
        assert!(worst <= TOL, "{name}: trust ratio rel err {worst:e}");
    }
}

// ---- PyTorch parity: the recorded trajectories replayed with the fused kernels ----

/// Issue 5's bound for the GPU against torch (the CPU replay in `torch_trajectories.rs` holds
/// 1e-6). The element-wise kernels perform the CPU optimizer's f32 operations in the same
/// order, but the device reductions (LAMB's global clip norm and per-tensor norms) sum in
/// another order than the CPU's, and a trust ratio or clip factor rounded differently moves
/// every element of its tensor at once: 1e-5 leaves that an order of magnitude of room while
/// still catching any wrong formula, which shows up at 1e-3 or worse after 20 steps.
const TORCH_TOL: f64 = 1e-5;

/// One case's device state. The CPU optimizer steps in lockstep on its own copy of the
/// parameters: it supplies each step's scalars (bias corrections, group learning rates,
/// LAMB's clip divisor), as a trainer's CPU side does, and its parameters give a GPU-vs-CPU
/// diagnostic. The GPU parameters are compared with torch's, never seeded from the CPU's.
// One value per case, built once: the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
enum GpuOpt {
    AdamW {
        cpu: tilearn_optim::AdamW,
        m: CudaSlice<f32>,
        v: CudaSlice<f32>,
        x: Option<CudaSlice<f32>>,
    },
    Adam {
        cpu: tilearn_optim::Adam,
        m: CudaSlice<f32>,
        v: CudaSlice<f32>,
        x: Option<CudaSlice<f32>>,
    },
    Sgd {
        cpu: tilearn_optim::Sgd,
        buf: Option<CudaSlice<f32>>,
    },
    Lamb {
        cpu: tilearn_optim::Lamb,
        m: CudaSlice<f32>,
        v: CudaSlice<f32>,
        scratch: tilearn_optim::cuda::LambScratch,
        norm: GradNorm,
        /// The groups cover the whole buffer, so Apex's clip norm (over group elements) is
        /// the device norm of the whole gradient buffer; otherwise the host norm is used.
        device_clip: bool,
    },
    Lion {
        cpu: tilearn_optim::Lion,
        m: CudaSlice<f32>,
    },
}

struct TorchReplay {
    plan: SegmentPlan,
    opt: GpuOpt,
    cpu_params: Vec<f32>,
}

impl TorchReplay {
    fn new(dev: &GpuDevice, case: &common::golden::Case, inputs: &common::golden::Inputs) -> Self {
        use tilearn_optim::cuda::{LambScratch, lamb_segments};
        use tilearn_optim::{Adam, Lamb, Lion, OptimizerConfig, Sgd};
        let s = dev.stream();
        let n = inputs.params0.len();
        let groups = case.groups.clone();
        let n_groups = groups.len();
        let segments = segments_of_n(&groups, n);
        let zeros = || upload(s, &vec![0.0f32; n]);
        let group_plan = || SegmentPlan::whole(s, &segments, n, n_groups).expect("plan");
        let (plan, opt) = match case.config {
            OptimizerConfig::AdamW(c) => (
                group_plan(),
                GpuOpt::AdamW {
                    cpu: AdamW::new(c, groups, n).expect("cpu adamw"),
                    m: zeros(),
                    v: zeros(),
                    x: c.amsgrad.then(zeros),
                },
            ),
            OptimizerConfig::Adam(c) => (
                group_plan(),
                GpuOpt::Adam {
                    cpu: Adam::new(c, groups, n).expect("cpu adam"),
                    m: zeros(),
                    v: zeros(),
                    x: c.amsgrad.then(zeros),
                },
            ),
            OptimizerConfig::Sgd(c) => (
                group_plan(),
                GpuOpt::Sgd {
                    cpu: Sgd::new(c, groups, n).expect("cpu sgd"),
                    // Poisoned: the first step must write the buffer without reading it.
                    buf: (c.momentum != 0.0).then(|| upload(s, &vec![f32::NAN; n])),
                },
            ),
            OptimizerConfig::Lamb(c) => {
                let cpu = Lamb::new(c, groups, n, inputs.tensors.clone()).expect("cpu lamb");
                // LAMB's plan segments are its trust-ratio tensors.
                let plan = SegmentPlan::whole(s, &lamb_segments(&cpu), n, n_groups).expect("plan");
                let covered: usize = segments.iter().map(|sg| sg.range.len()).sum();
                let opt = GpuOpt::Lamb {
                    scratch: LambScratch::new(s, &plan).expect("lamb scratch"),
                    norm: GradNorm::new(s).expect("norm scratch"),
                    device_clip: c.max_grad_norm.is_some() && covered == n,
                    cpu,
                    m: zeros(),
                    v: zeros(),
                };
                (plan, opt)
            }
            OptimizerConfig::Lion(c) => (
                group_plan(),
                GpuOpt::Lion {
                    cpu: Lion::new(c, groups, n).expect("cpu lion"),
                    m: zeros(),
                },
            ),
        };
        TorchReplay {
            plan,
            opt,
            cpu_params: inputs.params0.clone(),
        }
    }

    /// Step `step` (1-based) at `lr` with gradients `g` (host) / `g_dev` (the same f32 values
    /// on the device).
    fn step(
        &mut self,
        s: &Arc<CudaStream>,
        params: &mut CudaSlice<f32>,
        g: &[f32],
        g_dev: &CudaSlice<f32>,
        lr: f32,
        step: u64,
    ) {
        use tilearn_optim::cuda::{
            LambState, adam_l2_step, lamb_groups, lamb_max_norm, lamb_step, lion_step, sgd_step,
        };
        let TorchReplay {
            plan,
            opt,
            cpu_params,
        } = self;
        let n_groups = plan.n_groups();
        let mut io = StepIo::new(Grads::F32(g_dev.as_view()));
        io.step = step;
        match opt {
            GpuOpt::AdamW { cpu, m, v, x } => {
                let scalars: Vec<_> = (0..n_groups)
                    .map(|gi| cpu.step_scalars(gi, lr).expect("group"))
                    .collect();
                cpu.step(cpu_params, g, lr).expect("cpu step");
                let state = AdamState {
                    params: params.as_view_mut(),
                    exp_avg: m.as_view_mut(),
                    exp_avg_sq: v.as_view_mut(),
                    max_exp_avg_sq: x.as_mut().map(|x| x.as_view_mut()),
                };
                adamw_step(s, plan, &scalars, state, io).expect("fused adamw step");
            }
            GpuOpt::Adam { cpu, m, v, x } => {
                let scalars: Vec<_> = (0..n_groups)
                    .map(|gi| cpu.step_scalars(gi, lr).expect("group"))
                    .collect();
                cpu.step(cpu_params, g, lr).expect("cpu step");
                let state = AdamState {
                    params: params.as_view_mut(),
                    exp_avg: m.as_view_mut(),
                    exp_avg_sq: v.as_view_mut(),
                    max_exp_avg_sq: x.as_mut().map(|x| x.as_view_mut()),
                };
                adam_l2_step(s, plan, &scalars, state, io).expect("fused adam step");
            }
            GpuOpt::Sgd { cpu, buf } => {
                let scalars: Vec<_> = (0..n_groups)
                    .map(|gi| cpu.step_scalars(gi, lr).expect("group"))
                    .collect();
                cpu.step(cpu_params, g, lr).expect("cpu step");
                let b = buf.as_mut().map(|b| b.as_view_mut());
                sgd_step(s, plan, &scalars, params.as_view_mut(), b, io).expect("fused sgd step");
            }
            GpuOpt::Lamb {
                cpu,
                m,
                v,
                scratch,
                norm,
                device_clip,
            } => {
                let gnorm = cpu.global_grad_norm(g).expect("host norm");
                let groups = lamb_groups(cpu, lr, gnorm);
                cpu.step(cpu_params, g, lr).expect("cpu step");
                if *device_clip {
                    norm.compute(s, &Grads::F32(g_dev.as_view()), None)
                        .expect("device norm");
                    io.clip = Some(Clip {
                        grad_sumsq: norm.result(),
                        max_norm: lamb_max_norm(cpu).expect("max_grad_norm"),
                    });
                }
                let state = LambState {
                    params: params.as_view_mut(),
                    exp_avg: m.as_view_mut(),
                    exp_avg_sq: v.as_view_mut(),
                };
                lamb_step(s, plan, &groups, scratch, state, io).expect("fused lamb step");
            }
            GpuOpt::Lion { cpu, m } => {
                let scalars: Vec<_> = (0..n_groups)
                    .map(|gi| cpu.step_scalars(gi, lr).expect("group"))
                    .collect();
                cpu.step(cpu_params, g, lr).expect("cpu step");
                lion_step(s, plan, &scalars, params.as_view_mut(), m.as_view_mut(), io)
                    .expect("fused lion step");
            }
        }
    }

    /// The device optimizer state under torch's names, sorted by name.
    fn state(&self, dev: &GpuDevice) -> Vec<(String, Vec<f32>)> {
        let d = |b: &CudaSlice<f32>| download(dev, b);
        let mut out: Vec<(&str, Vec<f32>)> = match &self.opt {
            GpuOpt::AdamW { m, v, x, .. } | GpuOpt::Adam { m, v, x, .. } => {
                let mut o = vec![("exp_avg", d(m)), ("exp_avg_sq", d(v))];
                o.extend(x.iter().map(|x| ("max_exp_avg_sq", d(x))));
                o
            }
            GpuOpt::Sgd { buf, .. } => buf.iter().map(|b| ("momentum_buffer", d(b))).collect(),
            GpuOpt::Lamb { m, v, .. } => vec![("exp_avg", d(m)), ("exp_avg_sq", d(v))],
            GpuOpt::Lion { m, .. } => vec![("exp_avg", d(m))],
        };
        out.sort_by(|a, b| a.0.cmp(b.0));
        out.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    fn clip_note(&self) -> &'static str {
        match &self.opt {
            GpuOpt::Lamb {
                device_clip: true, ..
            } => ", clip norm on the device",
            GpuOpt::Lamb { cpu, .. } if cpu.config().max_grad_norm.is_some() => {
                ", clip divisor from the host norm"
            }
            _ => "",
        }
    }
}

fn segments_of_n(groups: &[ParamGroup], n: usize) -> Vec<Segment> {
    validate_groups(groups, n).expect("valid groups")
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn torch_trajectories_replay_on_gpu() {
    use common::golden::{CASES, golden_dir, load_case, load_inputs, rel_err};
    let test = "torch_trajectories_replay_on_gpu";
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let dir = golden_dir();
    let inputs = load_inputs(&dir);
    assert_eq!(inputs.grads.len(), 20, "the recordings have 20 steps");
    let n = inputs.params0.len();
    report(&format!("{test}: fixtures {}", dir.display()));
    for name in CASES {
        let case = load_case(&dir, &inputs, name);
        assert_eq!(
            case.config.name(),
            case.optimizer,
            "{test}: {name}: optimizer kind"
        );
        let mut replay = TorchReplay::new(&dev, &case, &inputs);
        let mut params = upload(s, &inputs.params0);
        let (mut max_err, mut worst_step, mut max_cpu_err) = (0.0f64, 0usize, 0.0f64);
        let mut gpu = Vec::new();
        let rows = case.trajectory.chunks_exact(n);
        for (t, ((g, &lr), want)) in inputs.grads.iter().zip(&case.lrs).zip(rows).enumerate() {
            let step = t + 1;
            let g_dev = upload(s, g);
            replay.step(s, &mut params, g, &g_dev, lr, step as u64);
            gpu = download(&dev, &params);
            let e = rel_err(&gpu, want);
            if e > max_err || step == 1 {
                max_err = e;
                worst_step = step;
            }
            max_cpu_err = max_cpu_err.max(rel_err(&gpu, &replay.cpu_params));
            assert!(
                e <= TORCH_TOL,
                "{test}: {name}: step {step}: GPU parameters' relative error to torch {e:e} > \
                 {TORCH_TOL:e} (GPU vs this crate's CPU optimizer: {:e})",
                rel_err(&gpu, &replay.cpu_params)
            );
        }
        let bits_differ = gpu
            .iter()
            .zip(&replay.cpu_params)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();

        // Final state against torch's (same names, same bound).
        let ours = replay.state(&dev);
        let names = |v: &[(String, Vec<f32>)]| v.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
        assert_eq!(
            names(&ours),
            names(&case.state),
            "{test}: {name}: state buffers"
        );
        let mut state_errs = Vec::new();
        for ((k, got), (_, want)) in ours.iter().zip(&case.state) {
            let e = rel_err(got, want);
            state_errs.push(format!("{k} {e:.2e}"));
            assert!(
                e <= TORCH_TOL,
                "{test}: {name}: state {k}: relative error to torch {e:e} > {TORCH_TOL:e}"
            );
        }
        report(&format!(
            "{test}: {name:>20}: max param rel err vs torch {max_err:.2e} (step {worst_step}, \
             bound {TORCH_TOL:e}), vs CPU optimizer {max_cpu_err:.2e} ({bits_differ} of {n} \
             final elements differ in bits){}, state vs torch [{}]",
            replay.clip_note(),
            state_errs.join(", ")
        ));
    }
}
