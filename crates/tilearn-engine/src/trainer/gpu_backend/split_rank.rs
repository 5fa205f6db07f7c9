//! What the tensor- and pipeline-parallel GPU backends answer alike as [`StepBackend`]s
//! (`tensor_parallel.rs`, `pipeline_parallel.rs`): both wrap the rank's [`GpuBackend`] in a
//! field `inner`, and differ in how they run a step, save and load; the rest is here once.
//!
//! [`StepBackend`]: crate::trainer::backend::StepBackend
//! [`GpuBackend`]: super::GpuBackend

/// The [`StepBackend`](crate::trainer::backend::StepBackend) methods a split rank answers by
/// its inner engine or its model group, for a struct with the fields `inner` (the rank's
/// `GpuBackend`), `name` and `full_specs` (the whole model's tensors) and a method
/// `group_sum_of_squares(&mut self, &Range<usize>) -> Result<f64>` (the rank's counted share of
/// the squared gradient norm over a range of its buffer, summed over its model group).
///
/// The norm: without ZeRO the rank sums it over the group and hands it to the fused AdamW's
/// clip input; under ZeRO data parallelism sums the owned range's over the replicas too and
/// hands it over through `clip_shard`, so the step only steps.
macro_rules! split_rank_methods {
    () => {
        fn describe(&self) -> String {
            self.name.clone()
        }

        fn supports(&self, precision: ::tilearn_ops::DType) -> bool {
            self.inner.supports(precision)
        }

        fn zero_grads(&mut self) {
            self.inner.zero_grads();
        }

        fn take_note(&mut self) -> Option<String> {
            self.inner.take_note()
        }

        fn optimizer_step(&mut self, lr: f32) -> $crate::Result<Option<f64>> {
            if self.inner.optimizer_sharded() {
                // ZeRO: `clip_shard` gave the step the sum over the model's and the replicas'
                // ranks.
                return self.inner.optimizer_step(lr);
            }
            let numel = self.inner.numel;
            let total = self.group_sum_of_squares(&(0..numel))?;
            self.inner.step_with_group_norm(total, lr)
        }

        fn specs(&self) -> &[$crate::params::ParamSpec] {
            &self.inner.specs
        }

        fn saved_specs(&self) -> &[$crate::params::ParamSpec] {
            &self.full_specs
        }

        fn flat_gradients(
            &mut self,
        ) -> $crate::Result<$crate::trainer::flat_buffer::FlatBuffer<'_>> {
            self.inner.flat_gradients()
        }

        fn flat_parameters(
            &mut self,
        ) -> $crate::Result<$crate::trainer::flat_buffer::FlatBuffer<'_>> {
            self.inner.flat_parameters()
        }

        fn shard_optimizer(&mut self, shard: ::std::ops::Range<usize>) -> $crate::Result<()> {
            self.inner.shard_optimizer(shard)
        }

        fn clip_shard(
            &mut self,
            range: ::std::ops::Range<usize>,
            sum_of_squares: f64,
            max_norm: f64,
        ) -> $crate::Result<()> {
            self.inner.clip_shard(range, sum_of_squares, max_norm)
        }

        fn stage_whole_weights(
            &mut self,
        ) -> $crate::Result<Option<$crate::trainer::flat_buffer::FlatBuffer<'_>>> {
            self.inner.stage_whole_weights()
        }

        fn grad_sum_of_squares(&mut self, range: ::std::ops::Range<usize>) -> $crate::Result<f64> {
            self.group_sum_of_squares(&range)
        }

        fn state_layout(&self) -> $crate::trainer::zero::StateBytes {
            self.inner.state_layout()
        }

        fn state_held(&self) -> $crate::trainer::zero::RankState {
            self.inner.state_held()
        }

        fn poison_gradients(&mut self) -> $crate::Result<()> {
            self.inner.poison_gradients()
        }

        fn peak_memory_bytes(&self) -> u64 {
            self.inner.peak_memory_bytes()
        }
    };
}

pub(crate) use split_rank_methods;
