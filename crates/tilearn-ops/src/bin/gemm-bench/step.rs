//! `gemm-bench step [--preset tinyllama-1.1b|llama-134m] [--seconds S]`: every matrix product of
//! one bf16 training step of a preset, through the engine's own linear-layer calls, replayed back
//! to back for `S` seconds (default 20), so the products' sustained time at the board's power
//! limit can be set beside their time on an idle board (`benches/power_floor.py`).
//!
//! Per decoder layer the seven projections (q, k, v, o, gate, up, down) run as the engine runs
//! them: [`linear_forward`] (`x·Wᵀ`), then in the backward [`linear_backward_with`] (`dx =`
//! and the f32 weight gradient written by its first product, as the CUDA-graph step does, and
//! added by the lm_head's later chunks), with k, v and up adding their input gradient into the
//! one before ([`linear_input_grad_add`]); the lm_head runs chunk by chunk of 2 048 tokens (the
//! engine's default chunk at these presets). Every layer has its own weights and f32 weight gradients,
//! as in a real step (so no layer finds another's weights in L2); activations of one shape share
//! a buffer. Random bf16 values: the tensor cores' power depends on the bits they multiply.
//!
//! One step runs as a warm-up (cuBLASLt's algorithm search), then after three idle seconds one
//! timed step (the burst time, from a cool board) and then steps back to back, each between two
//! CUDA events, two in flight. Prints one JSON line: products, TFLOP a step, burst ms and the
//! median ms of the second half (sustained), and both rates.

use std::time::{Duration, Instant};

use half::bf16;
use tilearn_ops::cuda::{
    CudaSlice, DevicePtrMut, Gemm, GpuDevice, WeightGrad, linear_backward_with, linear_forward,
    linear_input_grad_add,
};

use super::xorshift;

/// The bench presets' shapes; keep in sync with crates/tilearn-llm/src/presets.rs.
struct StepShape {
    name: &'static str,
    vocab: usize,
    hidden: usize,
    layers: usize,
    q_heads: usize,
    kv_heads: usize,
    inter: usize,
    tokens: usize,
}

const PRESETS: [StepShape; 2] = [
    StepShape {
        name: "llama-134m",
        vocab: 32000,
        hidden: 768,
        layers: 12,
        q_heads: 12,
        kv_heads: 12,
        inter: 2048,
        tokens: 16 * 1024,
    },
    StepShape {
        name: "tinyllama-1.1b",
        vocab: 32000,
        hidden: 2048,
        layers: 22,
        q_heads: 32,
        kv_heads: 4,
        inter: 5632,
        tokens: 8 * 2048,
    },
];

/// The engine's lm_head chunk at both presets (`LceChunk::Auto` at vocab 32 000 in bf16).
const LCE_CHUNK: usize = 2048;

/// One projection: (in, out) features and whether its input gradient adds into the previous
/// projection's (k and v into q's, up into gate's).
struct Proj {
    fan_in: usize,
    fan_out: usize,
    adds_dx: bool,
}

struct Layer {
    weights: Vec<CudaSlice<bf16>>,
    grads: Vec<CudaSlice<f32>>,
}

pub fn run(mut args: impl Iterator<Item = String>) -> Result<String, String> {
    let mut preset = "tinyllama-1.1b".to_string();
    let mut seconds = 20.0_f64;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--preset" => preset = args.next().ok_or("--preset needs a preset name")?,
            "--seconds" => {
                seconds = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&s: &f64| s > 0.0)
                    .ok_or("--seconds needs a positive number")?
            }
            other => {
                return Err(format!(
                    "usage: gemm-bench step [--preset NAME] [--seconds S]; got {other:?}"
                ));
            }
        }
    }
    let shape = PRESETS.iter().find(|p| p.name == preset).ok_or_else(|| {
        let names: Vec<_> = PRESETS.iter().map(|p| p.name).collect();
        format!("step: unknown --preset {preset:?} (one of {names:?})")
    })?;
    let dev = GpuDevice::new(0).map_err(|e| e.to_string())?;
    let gemm = Gemm::new(dev.stream()).map_err(|e| e.to_string())?;
    StepBench::new(&dev, shape)?.measure(&dev, &gemm, seconds)
}

struct StepBench<'a> {
    shape: &'a StepShape,
    projs: Vec<Proj>,
    layers: Vec<Layer>,
    head: Layer,
    /// Activations and gradients of the token dimension, sized for the widest projection.
    x: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
}

impl<'a> StepBench<'a> {
    fn new(dev: &GpuDevice, shape: &'a StepShape) -> Result<StepBench<'a>, String> {
        let s = dev.stream();
        let err = |e: cudarc::driver::DriverError| e.to_string();
        let (c, i) = (shape.hidden, shape.inter);
        let head_dim = c / shape.q_heads;
        let (q, kv) = (shape.q_heads * head_dim, shape.kv_heads * head_dim);
        let proj = |fan_in, fan_out, adds_dx| Proj {
            fan_in,
            fan_out,
            adds_dx,
        };
        let projs = vec![
            proj(c, q, false),
            proj(c, kv, true),
            proj(c, kv, true),
            proj(q, c, false),
            proj(c, i, false),
            proj(c, i, true),
            proj(i, c, false),
        ];
        let mut random = xorshift::<bf16>(0x2545_F491_4F6C_DD1D);
        let mut layer = |shapes: &[(usize, usize)]| -> Result<Layer, String> {
            let mut weights = Vec::new();
            let mut grads = Vec::new();
            for &(rows, cols) in shapes {
                weights.push(s.clone_htod(&random(rows * cols)).map_err(err)?);
                grads.push(s.alloc_zeros::<f32>(rows * cols).map_err(err)?);
            }
            Ok(Layer { weights, grads })
        };
        let shapes: Vec<_> = projs.iter().map(|p| (p.fan_out, p.fan_in)).collect();
        let layers = (0..shape.layers)
            .map(|_| layer(&shapes))
            .collect::<Result<Vec<_>, _>>()?;
        let head = layer(&[(shape.vocab, c)])?;
        let widest = projs
            .iter()
            .map(|p| p.fan_in.max(p.fan_out))
            .max()
            .unwrap_or(c);
        let len = (shape.tokens * widest).max(LCE_CHUNK * shape.vocab);
        let mut buf = || s.clone_htod(&random(len)).map_err(err);
        Ok(StepBench {
            shape,
            projs,
            layers,
            head,
            x: buf()?,
            y: buf()?,
            dy: buf()?,
            dx: buf()?,
        })
    }

    /// Products and FLOPs of one step.
    fn count(&self) -> (usize, f64) {
        let t = self.shape.tokens as f64;
        let per_layer: f64 = self
            .projs
            .iter()
            .map(|p| 3.0 * 2.0 * t * p.fan_in as f64 * p.fan_out as f64)
            .sum();
        let head = 3.0 * 2.0 * t * self.shape.hidden as f64 * self.shape.vocab as f64;
        let products =
            3 * self.projs.len() * self.shape.layers + 3 * self.shape.tokens.div_ceil(LCE_CHUNK);
        (products, per_layer * self.shape.layers as f64 + head)
    }

    /// One step's products, queued on the stream.
    fn step(&mut self, gemm: &Gemm) -> Result<(), String> {
        let t = self.shape.tokens;
        let e = |e: tilearn_ops::OpsError| e.to_string();
        for layer in &self.layers {
            for (p, w) in self.projs.iter().zip(&layer.weights) {
                let (x, y) = (
                    self.x.slice(..t * p.fan_in),
                    &mut self.y.slice_mut(..t * p.fan_out),
                );
                linear_forward(gemm, &x, w, None, t, p.fan_in, p.fan_out, y).map_err(e)?;
            }
        }
        let (c, vocab) = (self.shape.hidden, self.shape.vocab);
        for start in (0..t).step_by(LCE_CHUNK) {
            let rows = LCE_CHUNK.min(t - start);
            let x = self.x.slice(..rows * c);
            let mut logits = self.y.slice_mut(..rows * vocab);
            let w = &self.head.weights[0];
            linear_forward(gemm, &x, w, None, rows, c, vocab, &mut logits).map_err(e)?;
            let dlogits = self.dy.slice(..rows * vocab);
            let mut dx = self.dx.slice_mut(..rows * c);
            let dw = &mut self.head.grads[0];
            // The first chunk writes the lm_head's gradient, the later ones add to it.
            let dw_grad = if start == 0 {
                WeightGrad::Write
            } else {
                WeightGrad::Add
            };
            let dx: Option<&mut dyn DevicePtrMut<bf16>> = Some(&mut dx);
            linear_backward_with(gemm, &dlogits, &x, w, rows, c, vocab, dx, dw, None, dw_grad)
                .map_err(e)?;
        }
        for layer in self.layers.iter_mut().rev() {
            for (p, (w, dw)) in self
                .projs
                .iter()
                .zip(layer.weights.iter().zip(layer.grads.iter_mut()))
                .rev()
            {
                let (fan_in, fan_out) = (p.fan_in, p.fan_out);
                let x = self.x.slice(..t * fan_in);
                let dy = self.dy.slice(..t * fan_out);
                let mut dx = self.dx.slice_mut(..t * fan_in);
                // Each weight's one product writes its gradient.
                let dx: Option<&mut dyn DevicePtrMut<bf16>> = if p.adds_dx {
                    linear_input_grad_add(gemm, &dy, w, t, fan_in, fan_out, &mut dx).map_err(e)?;
                    None
                } else {
                    Some(&mut dx)
                };
                let write = WeightGrad::Write;
                linear_backward_with(gemm, &dy, &x, w, t, fan_in, fan_out, dx, dw, None, write)
                    .map_err(e)?;
            }
        }
        Ok(())
    }

    fn measure(mut self, dev: &GpuDevice, gemm: &Gemm, seconds: f64) -> Result<String, String> {
        let s = dev.stream().clone();
        let err = |e: cudarc::driver::DriverError| e.to_string();
        let sync = |d: &GpuDevice| d.synchronize().map_err(|e| e.to_string());
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        self.step(gemm)?;
        sync(dev)?;
        std::thread::sleep(Duration::from_secs(3));
        let timed = |bench: &mut StepBench| -> Result<_, String> {
            let start = s.record_event(flags).map_err(err)?;
            bench.step(gemm)?;
            let end = s.record_event(flags).map_err(err)?;
            Ok((start, end))
        };
        let (start, end) = timed(&mut self)?;
        let burst = start.elapsed_ms(&end).map_err(err)? as f64;
        let deadline = Instant::now() + Duration::from_secs_f64(seconds);
        let mut queued = std::collections::VecDeque::new();
        let mut times = Vec::new();
        while Instant::now() < deadline {
            queued.push_back(timed(&mut self)?);
            if queued.len() > 2 {
                let (a, b) = queued.pop_front().expect("three queued");
                times.push(a.elapsed_ms(&b).map_err(err)? as f64);
            }
        }
        for (a, b) in queued {
            times.push(a.elapsed_ms(&b).map_err(err)? as f64);
        }
        let mut late = times.split_off(times.len() / 2);
        late.sort_by(f64::total_cmp);
        let sustained = late
            .get(late.len() / 2)
            .copied()
            .ok_or("no step finished")?;
        let (products, flops) = self.count();
        let tflop = flops / 1e12;
        Ok(format!(
            "{{\"bench\":\"step-products\",\"preset\":{:?},\"products\":{products},\
             \"tflop\":{tflop:.4},\"burst_ms\":{burst:.3},\"sustained_ms\":{sustained:.3},\
             \"steps\":{},\"burst_tflops\":{:.1},\"sustained_tflops\":{:.1}}}",
            self.shape.name,
            times.len() + late.len(),
            tflop / burst * 1e3,
            tflop / sustained * 1e3
        ))
    }
}
