//! `gemm-bench [M [N [K]]] [--dtype bf16|f16|f32]`: the device's measured matmul ceiling
//! through the same cuBLASLt path the engine uses ([`Gemm::matmul`], f32 accumulation, TF32 off
//! for f32; the output has the input type).
//!
//! Random inputs (never zeros: zero operands can take faster paths), one warm-up product (which
//! also runs cuBLASLt's algorithm search, cached afterwards), then 10 timed products, each
//! between two CUDA events; prints the median as one JSON line:
//! `{"m":8192,"n":8192,"k":8192,"dtype":"bf16","ms":…,"tflops":…}` with
//! tflops = 2·M·N·K / median seconds / 1e12. Default 8192×8192×8192 bf16.
//!
//! `gemm-bench attention [--dtype bf16|f16]`: causal GQA attention, forward and backward, through
//! both implementations ([`AttentionImpl::Gemm`], cuBLASLt + row kernels, and
//! [`AttentionImpl::Flash`], the fused kernels) at the two preset shapes: llama-134m (B=16,
//! T=1024, Hq=Hkv=12, D=64) and TinyLlama (B=8, T=2048, Hq=32, Hkv=4, D=64). Random inputs, one
//! warm-up forward + backward, then 10 timed forwards and 10 timed backwards (CUDA events), one
//! JSON line per (shape, path) with the medians, then a table; also one sequence of 16 K tokens
//! with TinyLlama's heads, flash path only, and Llama-2-7B's heads (1 x 4096, 32/32, D=128).
//! `"kernels"` says which flash kernels ran (`wgmma` on Hopper where they apply, head_dim 128
//! included unless `TILEARN_FLASH_SM90_HD128=0`, else `mma.sync`; `TILEARN_FLASH_SM80=1`
//! forces the latter) and
//! `"backward"` which flash backward: the flash path is timed with a one-pass workspace (a row
//! only where that backward runs: Hopper kernels, unmasked) and a deterministic one. FLOPs
//! counted for causal attention: forward 2·2·B·Hq·T²·D/2 (the two products over the lower
//! triangle), backward 2.5× that (five products), whatever the path actually computes.
//!
//! `gemm-bench attention --example-len L`: the same with every row packed with examples of `L`
//! tokens (position ids restarting every `L`: the key-masked kernels, which skip the key tiles
//! outside each example), and with `--sliding-window W` a sliding window; the FLOPs counted are
//! then those of the keys each query sees (for packing `T/L` causal blocks of `L`), so TFLOP/s
//! stay comparable with the causal rows.
//!
//! `gemm-bench step [--preset NAME] [--seconds S]`: one training step's matrix products replayed
//! back to back, burst and sustained time (see `step.rs`).
//!
//! `gemm-bench attention --alibi`: the same with ALiBi slopes (Bloom's, one per query head; the
//! flash kernels' ALiBi instantiations), alone or with the flags above; same FLOPs counted.

mod step;

use std::process::ExitCode;

use half::{bf16, f16};
use tilearn_ops::KeyMask;
use tilearn_ops::cpu::AttnShape;
use tilearn_ops::cuda::{
    self, AttentionImpl, AttentionWorkspace, CudaSlice, DeviceFloat, FlashBackward, Gemm,
    GpuDevice, MatmulSpec, Operand,
};

const RUNS: usize = 10;

fn main() -> ExitCode {
    match run() {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gemm-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<String, String> {
    let mut dims = Vec::new();
    let mut dtype = "bf16".to_string();
    let mut attention = false;
    let mut mask = BenchMask::default();
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().is_some_and(|a| a == "step") {
        return step::run(args.skip(1));
    }
    while let Some(arg) = args.next() {
        if arg == "attention" {
            attention = true;
        } else if arg == "--alibi" {
            mask.alibi = true;
        } else if arg == "--example-len" || arg == "--sliding-window" {
            let n: usize = args
                .next()
                .and_then(|v| v.parse().ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{arg} needs a positive token count"))?;
            if arg == "--example-len" {
                mask.example_len = Some(n);
            } else {
                mask.window = Some(n);
            }
        } else if arg == "--dtype" {
            dtype = args.next().ok_or("--dtype needs bf16, f16 or f32")?;
        } else {
            let d: usize = arg.parse().map_err(|_| {
                format!("usage: gemm-bench [M [N [K]]] [--dtype bf16|f16|f32]; got {arg:?}")
            })?;
            if d == 0 {
                return Err("dimensions must be positive".into());
            }
            dims.push(d);
        }
    }
    if attention {
        let dev = GpuDevice::new(0).map_err(|e| e.to_string())?;
        let gemm = Gemm::new(dev.stream()).map_err(|e| e.to_string())?;
        return match dtype.as_str() {
            "bf16" => attention_bench::<bf16>(&dev, &gemm, mask),
            "f16" => attention_bench::<f16>(&dev, &gemm, mask),
            other => Err(format!(
                "attention: unknown --dtype {other:?} (bf16 or f16: f32 has no flash path)"
            )),
        };
    }
    let m = dims.first().copied().unwrap_or(8192);
    let n = dims.get(1).copied().unwrap_or(m);
    let k = dims.get(2).copied().unwrap_or(n);
    let dev = GpuDevice::new(0).map_err(|e| e.to_string())?;
    let gemm = Gemm::new(dev.stream()).map_err(|e| e.to_string())?;
    let ms = match dtype.as_str() {
        "bf16" => time::<bf16>(&dev, &gemm, m, n, k)?,
        "f16" => time::<f16>(&dev, &gemm, m, n, k)?,
        "f32" => time::<f32>(&dev, &gemm, m, n, k)?,
        other => return Err(format!("unknown --dtype {other:?} (bf16, f16 or f32)")),
    };
    let tflops = 2.0 * m as f64 * n as f64 * k as f64 / (ms / 1e3) / 1e12;
    let name = dev.name().unwrap_or_else(|_| "unknown".into());
    Ok(format!(
        "{{\"m\":{m},\"n\":{n},\"k\":{k},\"dtype\":\"{dtype}\",\"ms\":{ms:.4},\"tflops\":{tflops:.1},\"device\":{name:?}}}"
    ))
}

/// Median milliseconds of `C = A·Bᵀ` (the linear layer's "TN" layout) over [`RUNS`] products.
fn time<T: DeviceFloat>(
    dev: &GpuDevice,
    gemm: &Gemm,
    m: usize,
    n: usize,
    k: usize,
) -> Result<f64, String> {
    let s = dev.stream();
    let err = |e: cudarc::driver::DriverError| e.to_string();
    let mut random = xorshift::<T>(0x9E37_79B9_7F4A_7C15);
    let a: CudaSlice<T> = s.clone_htod(&random(m * k)).map_err(err)?;
    let b: CudaSlice<T> = s.clone_htod(&random(n * k)).map_err(err)?;
    // beta = 0: C is only written.
    let mut c: CudaSlice<T> = s.clone_htod(&random(m * n)).map_err(err)?;
    let spec = MatmulSpec::new(m, n, k, Operand::plain(k), Operand::transposed(k));
    gemm.matmul::<T, T>(&spec, &a, &b, &mut c)
        .map_err(|e| e.to_string())?;
    dev.synchronize().map_err(|e| e.to_string())?;
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let start = s.record_event(flags).map_err(err)?;
        gemm.matmul::<T, T>(&spec, &a, &b, &mut c)
            .map_err(|e| e.to_string())?;
        let end = s.record_event(flags).map_err(err)?;
        times.push(start.elapsed_ms(&end).map_err(err)? as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[RUNS / 2])
}

/// A small xorshift generator of `T` values uniform in ±[0.25, 1), enough to defeat any zero
/// shortcut.
fn xorshift<T: DeviceFloat>(seed: u64) -> impl FnMut(usize) -> Vec<T> {
    let mut state = seed;
    move |len: usize| -> Vec<T> {
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 40) as f32 / (1u64 << 24) as f32;
                let v = 0.25 + 0.75 * u;
                T::from_f32(if state & 1 == 0 { v } else { -v })
            })
            .collect()
    }
}

/// The attention bench's shapes: (name, shape). The last, one 16 K-token sequence with
/// TinyLlama's heads (issue 13's long-context shape), runs the flash path alone: the GEMM path's
/// [T × T] score matrix per head would not be a fair or small thing to time.
const ATTN_PRESETS: [(&str, AttnShape); 4] = [
    (
        "llama-134m",
        AttnShape {
            batch: 16,
            seq: 1024,
            q_heads: 12,
            kv_heads: 12,
            head_dim: 64,
        },
    ),
    (
        "tinyllama",
        AttnShape {
            batch: 8,
            seq: 2048,
            q_heads: 32,
            kv_heads: 4,
            head_dim: 64,
        },
    ),
    (
        "long-16k",
        AttnShape {
            batch: 1,
            seq: 16384,
            q_heads: 32,
            kv_heads: 4,
            head_dim: 64,
        },
    ),
    (
        "llama2-7b",
        AttnShape {
            batch: 1,
            seq: 4096,
            q_heads: 32,
            kv_heads: 32,
            head_dim: 128,
        },
    ),
];

/// The long shape's length: the GEMM path is timed only below it.
const GEMM_PATH_MAX_SEQ: usize = 4096;

/// The key mask of an attention bench: packed examples of one length, a sliding window, ALiBi.
#[derive(Clone, Copy, Debug, Default)]
struct BenchMask {
    example_len: Option<usize>,
    window: Option<usize>,
    /// ALiBi slopes on every query head.
    alibi: bool,
}

impl BenchMask {
    /// Keys each query of a row of `seq` sees, summed over the row.
    fn visible_keys(&self, seq: usize) -> f64 {
        let len = self.example_len.unwrap_or(seq).min(seq);
        (0..seq)
            .map(|i| {
                let lo = tilearn_ops::key_start(i, Some((i % len) as i32), self.window);
                (i + 1 - lo) as f64
            })
            .sum()
    }

    /// Position ids `[batch, seq]` restarting every `example_len` tokens.
    fn positions(&self, batch: usize, seq: usize) -> Option<Vec<i32>> {
        self.example_len.map(|len| {
            (0..batch)
                .flat_map(|_| (0..seq).map(move |t| (t % len) as i32))
                .collect()
        })
    }
}

/// Forward and backward medians (ms) of both paths at both presets; JSON lines, then a table.
fn attention_bench<T: DeviceFloat>(
    dev: &GpuDevice,
    gemm: &Gemm,
    mask: BenchMask,
) -> Result<String, String> {
    let name = dev.name().unwrap_or_else(|_| "unknown".into());
    let mut table = vec![format!(
        "{:<11} {:<6} {:<13} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "shape", "path", "backward", "fwd ms", "fwd TF/s", "bwd ms", "bwd TF/s", "total ms"
    )];
    for (preset, s) in ATTN_PRESETS {
        let fwd_flops = 4.0 * (s.batch * s.q_heads * s.head_dim) as f64 * mask.visible_keys(s.seq);
        let bwd_flops = 2.5 * fwd_flops;
        let runs = [
            (AttentionImpl::Gemm, FlashBackward::Deterministic),
            (AttentionImpl::Flash, FlashBackward::OnePass),
            (AttentionImpl::Flash, FlashBackward::Deterministic),
        ];
        for (imp, asked) in runs {
            if imp == AttentionImpl::Gemm && s.seq > GEMM_PATH_MAX_SEQ {
                continue;
            }
            let (fwd, bwd, ran) = time_attention::<T>(dev, gemm, s, imp, asked, mask)?;
            // The one-pass request runs the deterministic backward where the Hopper kernels
            // do not apply: that row would repeat the next one.
            if asked == FlashBackward::OnePass && ran != FlashBackward::OnePass {
                continue;
            }
            let (tf_f, tf_b) = (fwd_flops / fwd / 1e9, bwd_flops / bwd / 1e9);
            let path = format!("{imp:?}").to_lowercase();
            // Which flash kernels ran: the Hopper (wgmma) ones or the mma.sync ones.
            let masked = mask.example_len.is_some() || mask.window.is_some() || mask.alibi;
            let backward = match (imp, ran) {
                (AttentionImpl::Gemm, _) => "gemm",
                (_, FlashBackward::OnePass) => "one-pass",
                (_, FlashBackward::Deterministic) => "deterministic",
            };
            let kernels = match imp {
                AttentionImpl::Flash
                    if cuda::flash_attention_uses_wgmma::<T>(s.head_dim, masked) =>
                {
                    "wgmma"
                }
                AttentionImpl::Flash => "mma.sync",
                _ => "cublaslt",
            };
            println!(
                concat!(
                    "{{\"bench\":\"attention\",\"shape\":\"{}\",\"batch\":{},\"seq\":{},",
                    "\"q_heads\":{},\"kv_heads\":{},\"head_dim\":{},\"dtype\":\"{}\",",
                    "\"path\":\"{}\",\"kernels\":\"{}\",\"backward\":\"{}\",\"fwd_ms\":{:.4},",
                    "\"fwd_tflops\":{:.1},\"bwd_ms\":{:.4},",
                    "\"bwd_tflops\":{:.1},\"example_len\":{},\"sliding_window\":{},\"alibi\":{},",
                    "\"device\":{:?}}}"
                ),
                preset,
                s.batch,
                s.seq,
                s.q_heads,
                s.kv_heads,
                s.head_dim,
                T::NAME,
                path,
                kernels,
                backward,
                fwd,
                tf_f,
                bwd,
                tf_b,
                json_opt(mask.example_len),
                json_opt(mask.window),
                mask.alibi,
                name
            );
            table.push(format!(
                "{preset:<11} {path:<6} {backward:<13} {fwd:>9.3} {tf_f:>9.1} {bwd:>9.3} {tf_b:>9.1} {:>9.3}",
                fwd + bwd
            ));
        }
    }
    Ok(table.join("\n"))
}

/// A JSON number, or `null` for none (`{:?}` would print `None`, which no JSON reader takes).
fn json_opt(v: Option<usize>) -> String {
    v.map_or_else(|| "null".to_string(), |n| n.to_string())
}

/// Median forward and backward milliseconds of one path at one shape, and the flash backward
/// that ran (the flash path's workspace is built for `backward`).
fn time_attention<T: DeviceFloat>(
    dev: &GpuDevice,
    gemm: &Gemm,
    s: AttnShape,
    imp: AttentionImpl,
    backward: FlashBackward,
    mask: BenchMask,
) -> Result<(f64, f64, FlashBackward), String> {
    let st = dev.stream();
    let err = |e: cudarc::driver::DriverError| e.to_string();
    let ops = |e: tilearn_ops::OpsError| e.to_string();
    let ql = s.batch * s.seq * s.q_heads * s.head_dim;
    let kvl = s.batch * s.seq * s.kv_heads * s.head_dim;
    let mut random = xorshift::<T>(0x2545_F491_4F6C_DD1D);
    let q: CudaSlice<T> = st.clone_htod(&random(ql)).map_err(err)?;
    let k: CudaSlice<T> = st.clone_htod(&random(kvl)).map_err(err)?;
    let v: CudaSlice<T> = st.clone_htod(&random(kvl)).map_err(err)?;
    let dout: CudaSlice<T> = st.clone_htod(&random(ql)).map_err(err)?;
    let mut out: CudaSlice<T> = st.alloc_zeros(ql).map_err(err)?;
    let mut lse: CudaSlice<f32> = st.alloc_zeros(s.batch * s.q_heads * s.seq).map_err(err)?;
    let mut dq: CudaSlice<T> = st.alloc_zeros(ql).map_err(err)?;
    let mut dk: CudaSlice<T> = st.alloc_zeros(kvl).map_err(err)?;
    let mut dv: CudaSlice<T> = st.alloc_zeros(kvl).map_err(err)?;
    let pos: Option<CudaSlice<i32>> = match mask.positions(s.batch, s.seq) {
        Some(p) => Some(st.clone_htod(&p).map_err(err)?),
        None => None,
    };
    let key_mask = KeyMask {
        positions: pos.as_ref(),
        sliding_window: mask.window,
    };
    let slopes: Option<CudaSlice<f32>> = if mask.alibi {
        Some(
            st.clone_htod(&tilearn_ops::alibi_slopes(s.q_heads))
                .map_err(err)?,
        )
    } else {
        None
    };
    let slopes = slopes.as_ref();
    // The whole batch in one pass for the GEMM path; the flash path's own workspace.
    let mut ws = match imp {
        AttentionImpl::Flash => AttentionWorkspace::for_flash(st, s, backward),
        _ => AttentionWorkspace::new(st, s, size_of::<T>()),
    }
    .map_err(ops)?;
    let masked = mask.example_len.is_some() || mask.window.is_some() || mask.alibi;
    let ran = ws.flash_backward_for::<T>(s, masked);
    let fwd = |ws: &mut AttentionWorkspace, out: &mut CudaSlice<T>, lse: &mut CudaSlice<f32>| {
        cuda::attention_forward_alibi(imp, gemm, ws, s, key_mask, slopes, &q, &k, &v, out, lse)
    };
    let bwd = |ws: &mut AttentionWorkspace,
               dq: &mut CudaSlice<T>,
               dk: &mut CudaSlice<T>,
               dv: &mut CudaSlice<T>,
               out: &CudaSlice<T>,
               lse: &CudaSlice<f32>| {
        cuda::attention_backward_alibi(
            imp, gemm, ws, s, key_mask, slopes, &dout, &q, &k, &v, out, lse, dq, dk, dv,
        )
    };
    fwd(&mut ws, &mut out, &mut lse).map_err(ops)?;
    bwd(&mut ws, &mut dq, &mut dk, &mut dv, &out, &lse).map_err(ops)?;
    dev.synchronize().map_err(ops)?;
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut fwd_ms = Vec::with_capacity(RUNS);
    let mut bwd_ms = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let start = st.record_event(flags).map_err(err)?;
        fwd(&mut ws, &mut out, &mut lse).map_err(ops)?;
        let end = st.record_event(flags).map_err(err)?;
        fwd_ms.push(start.elapsed_ms(&end).map_err(err)? as f64);
    }
    for _ in 0..RUNS {
        let start = st.record_event(flags).map_err(err)?;
        bwd(&mut ws, &mut dq, &mut dk, &mut dv, &out, &lse).map_err(ops)?;
        let end = st.record_event(flags).map_err(err)?;
        bwd_ms.push(start.elapsed_ms(&end).map_err(err)? as f64);
    }
    fwd_ms.sort_by(f64::total_cmp);
    bwd_ms.sort_by(f64::total_cmp);
    Ok((fwd_ms[RUNS / 2], bwd_ms[RUNS / 2], ran))
}
