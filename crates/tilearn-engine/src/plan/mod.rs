//! The parallel-plan advisor behind `tilearn plan`: for a model and a set of GPUs, every
//! tensor/pipeline/data-parallel layout with its ZeRO stage, micro-batch and activation
//! checkpointing, the memory of its worst rank term by term as the GPU engine allocates it, and
//! a predicted step time; the fastest layout that fits is the recommendation.
//!
//! It predicts; it runs nothing. The memory model is checked against the single-GPU engine's
//! measured peaks (`calibration` tests, errors stated in docs/ARCHITECTURE.md); the cost model's
//! compute rates are the H200's measured ones, its interconnect rates stated assumptions.
//! The layouts follow Megatron's order (TP innermost, then DP, then PP), as the engines' groups
//! do; every layout is priced, and only those the GPU engine runs today are recommended
//! ([`engine_support`]).
//!
//! Data-parallel schedules per ZeRO stage (what [`cost`] charges): stage 0 all-reduces the
//! gradients once, under the last micro-batch's backward; stage 1 reduce-scatters them likewise
//! and all-gathers the updated working weights; stage 2 reduce-scatters after every
//! micro-batch; stage 3 also gathers each layer's weights for the forward and the backward.

pub mod cost;
pub mod engine_support;
pub mod hardware;
pub mod layout;
pub mod memory;
pub mod search;
pub mod shard;

#[cfg(test)]
mod calibration;

pub use cost::{StepCost, flops_per_token};
pub use hardware::Hardware;
pub use layout::{Layout, ShardStage};
pub use memory::MemoryBreakdown;
pub use search::{Candidate, Plan, PlanRequest, plan};
