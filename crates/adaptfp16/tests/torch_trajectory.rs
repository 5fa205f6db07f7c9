//! Replays PyTorch's own GradScaler trajectory (tests/amp_golden, written by
//! make_scaler_golden.py) and demands bit equality: scale before and after every step, the
//! scaled loss, found_inf, the skip decision, the growth tracker, and every unscaled gradient.
//! Then resumes from torch's mid-run `state_dict()` and checks the rest of the run again, and
//! compares the final state dicts.
//!
//! Set AMP_GOLDEN_DIR to replay another copy of the fixture (e.g. one regenerated on a GPU).

use std::path::PathBuf;

use adaptfp16::{CpuGrads, GradScaler, ScalerConfig};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

fn fixture_dir() -> PathBuf {
    match std::env::var_os("AMP_GOLDEN_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/amp_golden"),
    }
}

struct Fixture {
    meta: Value,
    tensors: Vec<u8>,
}

fn load() -> Fixture {
    let dir = fixture_dir();
    let json = std::fs::read(dir.join("scaler_golden.json"))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let tensors = std::fs::read(dir.join("scaler_golden.safetensors")).unwrap();
    Fixture {
        meta: serde_json::from_slice(&json).unwrap(),
        tensors,
    }
}

fn u64_of(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("missing integer {key}"))
}

fn f32_vec(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Bit equality, except that any NaN matches any NaN (payloads are not part of torch's contract
/// and differ between CPU and GPU).
fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn config_of(sc: &Value) -> ScalerConfig {
    ScalerConfig {
        init_scale: f64::from_bits(u64_of(sc, "init_scale_bits")),
        growth_factor: f64::from_bits(u64_of(sc, "growth_factor_bits")),
        backoff_factor: f64::from_bits(u64_of(sc, "backoff_factor_bits")),
        growth_interval: i32::try_from(u64_of(sc, "growth_interval")).unwrap(),
        enabled: true,
    }
}

/// Replays steps `from..` of scenario `sc` on `scaler`; returns the number of values compared.
fn replay(scaler: &mut GradScaler, sc: &Value, st: &SafeTensors<'_>, from: usize) -> usize {
    let name = sc["name"].as_str().unwrap();
    let n_tensors = sc["sizes"].as_array().unwrap().len();
    let records = sc["records"].as_array().unwrap();
    let mut compared = 0;
    for r in &records[from..] {
        let step = u64_of(r, "step");
        let at = format!("{name} step {step}");
        let bits = |k: &str| u32::try_from(u64_of(r, k)).unwrap();

        assert_eq!(
            scaler.get_scale().to_bits(),
            bits("scale_before_bits"),
            "{at}: scale before: ours {:e} torch {:e}",
            scaler.get_scale(),
            f32::from_bits(bits("scale_before_bits"))
        );
        let loss = f32::from_bits(bits("loss_bits"));
        let scaled = scaler.scale(f64::from(loss)) as f32;
        assert!(
            same_f32(scaled, f32::from_bits(bits("scaled_loss_bits"))),
            "{at}: scaled loss {scaled:e}"
        );

        let mut grads: Vec<Vec<f32>> = (0..n_tensors)
            .map(|i| f32_vec(st, &format!("{name}.{step:03}.{i}.in")))
            .collect();
        let mut target = CpuGrads::new(grads.iter_mut().map(|g| g.as_mut_slice()).collect());
        scaler.unscale(&mut target).unwrap();
        let skip = scaler.should_skip_step(&mut target).unwrap();
        let outcome = scaler.update(&mut target).unwrap();
        drop(target);

        assert_eq!(
            outcome.found_inf,
            r["found_inf"].as_bool().unwrap(),
            "{at}: found_inf"
        );
        assert_eq!(
            skip,
            !r["optimizer_stepped"].as_bool().unwrap(),
            "{at}: skip"
        );
        assert_eq!(skip, outcome.skipped(), "{at}: outcome.skipped");
        assert_eq!(
            outcome.scale_after.to_bits(),
            bits("scale_after_bits"),
            "{at}: scale after: ours {:e} torch {:e}",
            outcome.scale_after,
            f32::from_bits(bits("scale_after_bits"))
        );
        assert_eq!(
            i64::from(outcome.growth_tracker),
            r["growth_tracker"].as_i64().unwrap(),
            "{at}: growth tracker"
        );
        for (i, g) in grads.iter().enumerate() {
            let want = f32_vec(st, &format!("{name}.{step:03}.{i}.out"));
            assert_eq!(g.len(), want.len());
            for (j, (&a, &b)) in g.iter().zip(&want).enumerate() {
                assert!(
                    same_f32(a, b),
                    "{at}: tensor {i}[{j}]: ours {a:e} ({:#010x}) torch {b:e} ({:#010x})",
                    a.to_bits(),
                    b.to_bits()
                );
            }
            compared += g.len();
        }
        compared += 6;
    }
    compared
}

#[test]
fn reproduces_torch_gradscaler_trajectory_bit_for_bit() {
    let fx = load();
    let st = SafeTensors::deserialize(&fx.tensors).unwrap();
    let scenarios = fx.meta["scenarios"].as_array().unwrap();
    assert!(
        scenarios.len() >= 4,
        "fixture has {} scenarios",
        scenarios.len()
    );
    let mut total = 0;
    for sc in scenarios {
        let name = sc["name"].as_str().unwrap();
        let records = sc["records"].as_array().unwrap();
        let mut scaler = GradScaler::with_config(config_of(sc)).unwrap();
        let compared = replay(&mut scaler, sc, &st, 0);
        total += compared;

        // Our final state dict is torch's, key for key.
        let ours = scaler.state_dict_json();
        let theirs = &sc["final_state_dict"];
        // torch's five keys plus our two counters.
        assert_eq!(ours.as_object().unwrap().len(), 7, "{name}: {ours}");
        let skipped_count = ours["_overflow_count"].as_u64().unwrap();
        for key in ["growth_interval", "_growth_tracker"] {
            assert_eq!(ours[key].as_i64(), theirs[key].as_i64(), "{name}: {key}");
        }
        for key in ["scale", "growth_factor", "backoff_factor"] {
            let (a, b) = (ours[key].as_f64().unwrap(), theirs[key].as_f64().unwrap());
            assert_eq!(a as f32, b as f32, "{name}: {key}");
        }
        let skipped = records
            .iter()
            .filter(|r| !r["optimizer_stepped"].as_bool().unwrap())
            .count();
        assert_eq!(skipped_count, skipped as u64, "{name}: overflow counter");
        eprintln!(
            "{name}: {} steps, {skipped} skipped, final scale {:e}, {compared} values bit-equal",
            records.len(),
            scaler.get_scale()
        );
    }
    eprintln!(
        "fixture from torch {} on {} ({}): {total} values bit-equal",
        fx.meta["torch"], fx.meta["device"], fx.meta["device_name"]
    );
}

#[test]
fn resumes_from_torch_mid_run_state_dict() {
    let fx = load();
    let st = SafeTensors::deserialize(&fx.tensors).unwrap();
    for sc in fx.meta["scenarios"].as_array().unwrap() {
        let mid = &sc["mid_state"];
        let after = usize::try_from(u64_of(mid, "after_step")).unwrap();
        // A scaler built with other settings: everything must come from torch's state dict.
        let mut scaler = GradScaler::new();
        scaler.load_state_dict_json(&mid["state_dict"]).unwrap();
        let n = replay(&mut scaler, sc, &st, after + 1);
        assert!(n > 0);
    }
}

#[test]
fn fixture_plants_what_it_claims() {
    // Guards the fixture itself: every planted step found an inf, no other step did, and the
    // trajectory both grows and backs off (otherwise the replay proves little).
    let fx = load();
    for sc in fx.meta["scenarios"].as_array().unwrap() {
        let name = sc["name"].as_str().unwrap();
        let planted = sc["planted"].as_object().unwrap();
        let mut grew = 0;
        for r in sc["records"].as_array().unwrap() {
            let step = u64_of(r, "step").to_string();
            assert_eq!(
                r["found_inf"].as_bool().unwrap(),
                planted.contains_key(&step),
                "{name} step {step}"
            );
            let (before, after) = (
                u64_of(r, "scale_before_bits"),
                u64_of(r, "scale_after_bits"),
            );
            if f32::from_bits(after as u32) > f32::from_bits(before as u32) {
                grew += 1;
            }
        }
        if name != "collapse_to_zero" {
            assert!(grew >= 1, "{name}: the scale never grew");
        }
        assert!(!planted.is_empty(), "{name}: nothing planted");
    }
}
