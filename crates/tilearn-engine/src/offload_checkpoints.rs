//! `--offload-checkpoints auto|on|off`: whether the GPU engine keeps the layer inputs that
//! gradient checkpointing saves (and each layer's flash attention output) in page-locked host
//! memory instead of on the device. No device code here (the setting parses and resolves on
//! any machine); the device side is `gpu::resid_offload`.
//!
//! **On** copies each layer's input and attention output to the host after its forward, on a
//! second stream, and brings them back one layer ahead in the backward, whose recomputation
//! then skips the attention forward. At TinyLlama 1 × 16 / 32 / 64 K tokens on an H200 it was
//! 13 / 17 / 21 % faster than on-device checkpoints and 1.2 / 2.3 / 4.7 GiB leaner
//! (bench/RESULTS.md). Its costs: host memory (`(layers + 1) · N · C` plus `layers` attention
//! outputs, 16-bit, and their f32 log-sum-exps: 2.8 GiB at 16 K) and eager steps (the copy
//! stream is outside what the step's CUDA graph holds), which matter for short steps.
//!
//! **Auto** (the default) is on where those costs are small against the gain: gradient
//! checkpointing in the default memory mode, a whole model (not a pipeline stage), CUDA
//! graphs not forced `on`, sequences of at least [`AUTO_MIN_SEQ`] tokens (where the attention
//! forward the recomputation skips is the costliest part of a layer, and a step is long enough
//! that replaying it as a graph gains nothing), and host memory to spare: the page-locked room
//! at most [`AUTO_HOST_SHARE`] of the host's available memory divided among the processes of
//! this host. Elsewhere it is off and says why.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

/// Shortest sequence `auto` offloads at (measured faster from 16 K on; shorter sequences
/// were not measured, and their steps gain from CUDA graphs).
pub const AUTO_MIN_SEQ: usize = 16 * 1024;

/// Layer inputs the device keeps under offload: the one a layer reads, the one it writes, and
/// the one being copied (see `gpu::resid_offload`).
pub const DEVICE_RING_SLOTS: usize = 3;

/// Largest share of the host's available memory `auto` pins for one host's processes.
pub const AUTO_HOST_SHARE: f64 = 0.5;

/// `--offload-checkpoints`: the requested placement of checkpointed activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadCheckpoints {
    /// On for long sequences under checkpointing when host memory allows (see the module).
    #[default]
    Auto,
    /// Always (needs gradient checkpointing; refused where it cannot run).
    On,
    /// Never: the checkpoints stay on the device.
    Off,
}

impl fmt::Display for OffloadCheckpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OffloadCheckpoints::Auto => "auto",
            OffloadCheckpoints::On => "on",
            OffloadCheckpoints::Off => "off",
        })
    }
}

/// Accepts the names and, as saved arguments of earlier versions held it, a boolean.
impl<'de> Deserialize<'de> for OffloadCheckpoints {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Saved {
            Flag(bool),
            Name(String),
        }
        match Saved::deserialize(d)? {
            Saved::Flag(true) => Ok(OffloadCheckpoints::On),
            Saved::Flag(false) => Ok(OffloadCheckpoints::Off),
            Saved::Name(name) => OffloadCheckpoints::parse(&name).map_err(serde::de::Error::custom),
        }
    }
}

/// What `auto` weighs (an explicit `on`/`off` is taken as asked).
#[derive(Clone, Copy, Debug)]
pub struct OffloadSetting {
    pub gradient_checkpointing: bool,
    /// `--memory lean`.
    pub lean: bool,
    /// The model is one pipeline stage (offload is not implemented there).
    pub pipeline_stage: bool,
    /// `--cuda-graphs on`: every step must be a graph, which the copy stream is not.
    pub cuda_graphs_forced: bool,
    /// Tokens per sequence.
    pub seq: usize,
    /// Page-locked bytes the offload would take (`GpuLlama::checkpoint_offload_host_bytes`).
    pub host_bytes: usize,
    /// The host's available memory (`None`: unknown, and `auto` stays off).
    pub host_available: Option<usize>,
    /// Processes of this job on this host, each taking its own room.
    pub local_processes: usize,
}

/// The resolved setting: whether to offload, and for `auto`, why (shown with the run's
/// features).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadDecision {
    pub offload: bool,
    pub reason: Option<String>,
}

const GIB: f64 = (1u64 << 30) as f64;

impl OffloadCheckpoints {
    /// Parses the flag's text (`auto`, `on`, `off`, and `true`/`false`; case-insensitive).
    pub fn parse(text: &str) -> std::result::Result<OffloadCheckpoints, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(OffloadCheckpoints::Auto),
            "on" | "true" | "yes" => Ok(OffloadCheckpoints::On),
            "off" | "false" | "no" => Ok(OffloadCheckpoints::Off),
            _ => Err(format!(
                "`{text}` is not a checkpoint placement; use `auto` (host memory for long \
                 sequences under gradient checkpointing when the host has room), `on` or `off`"
            )),
        }
    }

    /// Whether to offload under `setting`. `on` and `off` are taken as asked (the engine
    /// refuses an `on` that cannot run, naming the fix); `auto` is on only where every
    /// condition of the module holds, and otherwise names the first that does not.
    pub fn resolve(self, setting: &OffloadSetting) -> OffloadDecision {
        let auto_off = |why: String| OffloadDecision {
            offload: false,
            reason: Some(why),
        };
        match self {
            OffloadCheckpoints::On => OffloadDecision {
                offload: true,
                reason: None,
            },
            OffloadCheckpoints::Off => OffloadDecision {
                offload: false,
                reason: None,
            },
            OffloadCheckpoints::Auto => {
                let s = setting;
                if !s.gradient_checkpointing {
                    // Nothing to offload: no note.
                    return OffloadDecision {
                        offload: false,
                        reason: None,
                    };
                }
                if s.lean {
                    return auto_off("checkpoints on the GPU: --memory lean".into());
                }
                if s.pipeline_stage {
                    return auto_off("checkpoints on the GPU: a pipeline stage".into());
                }
                if s.cuda_graphs_forced {
                    return auto_off("checkpoints on the GPU: --cuda-graphs on".into());
                }
                if s.seq < AUTO_MIN_SEQ {
                    return auto_off(format!(
                        "checkpoints on the GPU: sequences of {} tokens (auto offloads from \
                         {AUTO_MIN_SEQ})",
                        s.seq
                    ));
                }
                let Some(available) = s.host_available else {
                    return auto_off(
                        "checkpoints on the GPU: the host's available memory is unknown".into(),
                    );
                };
                let share = available as f64 * AUTO_HOST_SHARE / s.local_processes.max(1) as f64;
                if s.host_bytes as f64 > share {
                    return auto_off(format!(
                        "checkpoints on the GPU: offloading needs {:.1} GiB of host memory, \
                         more than this process's share ({:.1} GiB of {:.1} GiB available)",
                        s.host_bytes as f64 / GIB,
                        share / GIB,
                        available as f64 / GIB
                    ));
                }
                OffloadDecision {
                    offload: true,
                    reason: Some(format!(
                        "auto: sequences of {} tokens, {:.1} GiB of host memory",
                        s.seq,
                        s.host_bytes as f64 / GIB
                    )),
                }
            }
        }
    }
}

/// The host's available memory (`MemAvailable` of `/proc/meminfo`); `None` elsewhere.
pub fn host_available_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<usize> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let kib: usize = parts.next()?.parse().ok()?;
    (parts.next()? == "kB").then_some(kib * 1024)
}

/// Processes of the job on this host (`LOCAL_WORLD_SIZE`, as the launcher and torchrun set
/// it; 1 when unset or unreadable).
pub fn local_processes() -> usize {
    std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB_BYTES: usize = 1 << 30;

    fn long_context() -> OffloadSetting {
        OffloadSetting {
            gradient_checkpointing: true,
            lean: false,
            pipeline_stage: false,
            cuda_graphs_forced: false,
            seq: 16 * 1024,
            host_bytes: 3 * GIB_BYTES,
            host_available: Some(100 * GIB_BYTES),
            local_processes: 1,
        }
    }

    #[test]
    fn parses_each_name_and_refuses_others_with_the_choices() {
        assert_eq!(
            OffloadCheckpoints::parse("auto"),
            Ok(OffloadCheckpoints::Auto)
        );
        assert_eq!(
            OffloadCheckpoints::parse(" ON "),
            Ok(OffloadCheckpoints::On)
        );
        assert_eq!(
            OffloadCheckpoints::parse("false"),
            Ok(OffloadCheckpoints::Off)
        );
        let err = OffloadCheckpoints::parse("host").unwrap_err();
        assert!(err.contains("`host`") && err.contains("auto"), "{err}");
        for o in [
            OffloadCheckpoints::Auto,
            OffloadCheckpoints::On,
            OffloadCheckpoints::Off,
        ] {
            assert_eq!(OffloadCheckpoints::parse(&o.to_string()), Ok(o));
        }
    }

    #[test]
    fn saved_booleans_and_names_load() {
        let load = |json: &str| serde_json::from_str::<OffloadCheckpoints>(json).unwrap();
        assert_eq!(load("true"), OffloadCheckpoints::On);
        assert_eq!(load("false"), OffloadCheckpoints::Off);
        assert_eq!(load("\"auto\""), OffloadCheckpoints::Auto);
        let json = serde_json::to_string(&OffloadCheckpoints::Off).unwrap();
        assert_eq!(load(&json), OffloadCheckpoints::Off);
        assert!(serde_json::from_str::<OffloadCheckpoints>("\"host\"").is_err());
    }

    #[test]
    fn auto_offloads_long_checkpointed_sequences_when_the_host_has_room() {
        let auto = OffloadCheckpoints::Auto;
        let yes = auto.resolve(&long_context());
        assert!(yes.offload, "{yes:?}");
        let off = |s: OffloadSetting, says: &str| {
            let d = auto.resolve(&s);
            assert!(!d.offload, "{d:?}");
            let why = d.reason.unwrap_or_default();
            assert!(why.contains(says), "{why}");
        };
        off(
            OffloadSetting {
                seq: 8192,
                ..long_context()
            },
            "8192 tokens",
        );
        off(
            OffloadSetting {
                lean: true,
                ..long_context()
            },
            "--memory lean",
        );
        off(
            OffloadSetting {
                pipeline_stage: true,
                ..long_context()
            },
            "pipeline stage",
        );
        off(
            OffloadSetting {
                cuda_graphs_forced: true,
                ..long_context()
            },
            "--cuda-graphs on",
        );
        off(
            OffloadSetting {
                host_available: None,
                ..long_context()
            },
            "unknown",
        );
        // 3 GiB each for 8 processes of this host: 24 GiB against half of 40 GiB.
        off(
            OffloadSetting {
                host_available: Some(40 * GIB_BYTES),
                local_processes: 8,
                ..long_context()
            },
            "share (2.5 GiB of 40.0 GiB",
        );
        let none = auto.resolve(&OffloadSetting {
            gradient_checkpointing: false,
            ..long_context()
        });
        assert_eq!(
            none,
            OffloadDecision {
                offload: false,
                reason: None
            }
        );
    }

    #[test]
    fn on_and_off_are_taken_as_asked() {
        let short = OffloadSetting {
            seq: 128,
            host_available: None,
            ..long_context()
        };
        assert!(OffloadCheckpoints::On.resolve(&short).offload);
        assert!(!OffloadCheckpoints::Off.resolve(&long_context()).offload);
    }

    #[test]
    fn mem_available_is_read_in_kib() {
        let text = "MemTotal:       131072000 kB\nMemFree:  1000 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(text), Some(2 * 1024 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
    }
}
