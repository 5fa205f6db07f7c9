//! Criterion bench of the host optimizer step the lean memory mode runs every step (fp32
//! master weights and AdamW moments in host memory): the deterministic gradient norm, then
//! either the three passes it used to make (gradients scaled by the clip coefficient,
//! `AdamW::step`, the bf16 cast of the weights) or `AdamW::step_fused`, which does the same in
//! one pass over the state with the same bits. Throughput is parameters per second.
//!
//! `TILEARN_BENCH_PARAMS` sets the parameter count (default 2e7; the host needs about 22
//! bytes per parameter). Measured on the 2-core development machine (2026-12-03, 2e7
//! parameters): norm 2.20 ms, three passes 34.7 ms, fused 21.3 ms (1.63×).
//!
//! Run: `cargo bench -p tilearn-optim --bench host_step`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tilearn_optim::bf16_copy::cast_to_bf16_bits;
use tilearn_optim::clip::clip_coefficient;
use tilearn_optim::{AdamW, AdamWConfig, ParamGroup, global_grad_norm};

fn params() -> usize {
    std::env::var("TILEARN_BENCH_PARAMS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(20_000_000, |f| f as usize)
}

/// Decayed and undecayed halves, as a model's matrices and norms.
#[allow(clippy::single_range_in_vec_init)] // each group holds one range, on purpose
fn optimizer(n: usize) -> AdamW {
    let groups = vec![
        ParamGroup::new("decay", vec![0..n / 2], 0.1),
        ParamGroup::new("no_decay", vec![n / 2..n], 0.0),
    ];
    AdamW::new(AdamWConfig::default(), groups, n).expect("optimizer")
}

fn host_step(c: &mut Criterion) {
    let n = params();
    let grads: Vec<f32> = (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-3).collect();
    let init: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-4).collect();
    let mut group = c.benchmark_group("host_step");
    group
        .sample_size(10)
        .throughput(Throughput::Elements(n as u64));

    group.bench_function("norm", |b| b.iter(|| global_grad_norm(&grads)));

    let (mut opt, mut p, mut copy) = (optimizer(n), init.clone(), vec![0u16; n]);
    let mut scaled = grads.clone();
    group.bench_function("three_passes", |b| {
        b.iter(|| {
            let norm = global_grad_norm(&scaled);
            let coef = clip_coefficient(norm, 1.0).map_or(1.0, |c| c as f32);
            scaled.iter_mut().for_each(|g| *g *= coef);
            opt.step(&mut p, &scaled, 1e-3).expect("step");
            cast_to_bf16_bits(&p, &mut copy);
        })
    });

    let (mut opt, mut p) = (optimizer(n), init);
    group.bench_function("fused", |b| {
        b.iter(|| {
            let norm = global_grad_norm(&grads);
            let coef = clip_coefficient(norm, 1.0).map_or(1.0, |c| c as f32);
            opt.step_fused(&mut p, &grads, 1e-3, coef, Some(&mut copy))
                .expect("step");
        })
    });
    group.finish();
}

criterion_group!(benches, host_step);
criterion_main!(benches);
