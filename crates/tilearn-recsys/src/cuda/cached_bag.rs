//! The row cache of tables larger than the GPU (`crate::cache`) with the cache on the device:
//! every table's rows and optimizer state live in page-locked host memory mapped into the
//! device's address space ([`MappedHost`]), the cache in a [`DeviceEmbeddingBag`] over the
//! cache's tables. Per batch the host planner ([`RowCachePlanner`]) yields the moves; they
//! become copy lists ([`BatchCopies`]), uploaded in one transfer, and one launch of
//! `row_copy.cu` per buffer and direction carries them out over the bus (write-backs of dirty
//! evicted rows first, then loads) before the batch is uploaded with slot ids. Tables that fit
//! whole (resident, see the planner) are copied in when the cache is made and out when it is
//! flushed. The result is the host cache's bit for bit, so that of training the whole tables
//! on the device (`tests/row_cache_gpu.rs`).
//!
//! The copies' device time is measured with CUDA events around them and read one batch later
//! (by then the step's loss download has waited for them), so measuring adds no wait.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys};

use super::embedding_bag::{DeviceEmbeddingBag, DeviceJaggedBatch};
use super::row_copy::{MappedHost, copy_rows_to_device, copy_rows_to_host, upload_words};
use crate::cache::{
    BatchCopies, RowCachePlanner, RowCacheReport, RowCopies, copy_elements, state_copies,
};
use crate::error::{RecsysError, Result};
use crate::jagged::JaggedBatch;
use crate::sparse_optim::{SparseOptimizer, SparseState};
use crate::tables::{EmbeddingTables, TableLayout};

fn driver(context: &'static str) -> impl Fn(cudarc::driver::DriverError) -> RecsysError {
    move |e| {
        RecsysError::Ops(tilearn_ops::OpsError::Cuda {
            context,
            message: e.to_string(),
        })
    }
}

/// The host tables: weights and the rule's state buffers (`None` where it keeps none).
#[derive(Debug)]
struct HostRows {
    weights: MappedHost,
    state1: Option<MappedHost>,
    state2: Option<MappedHost>,
}

/// Which way a copy list runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToHost,
    ToDevice,
}

/// Embedding tables in pinned host memory with a GPU cache of hot rows.
#[derive(Debug)]
pub struct DeviceCachedEmbeddingBag {
    backing: TableLayout,
    optimizer: SparseOptimizer,
    host: HostRows,
    device: DeviceEmbeddingBag,
    planner: RowCachePlanner,
    /// The current batch's copy lists on the device.
    copies: CudaSlice<u64>,
    traffic: RowCacheReport,
    /// Events around the last batch's copies, not yet read.
    pending: Option<(CudaEvent, CudaEvent)>,
}

impl DeviceCachedEmbeddingBag {
    /// A device cache of `slots[t]` rows of table `t` (a table with at least its rows in slots
    /// lives on the device whole) in front of `backing` and its optimizer `state`, both moved
    /// into pinned host memory.
    pub fn new(
        stream: &Arc<CudaStream>,
        backing: EmbeddingTables,
        state: SparseState,
        slots: &[usize],
    ) -> Result<Self> {
        state.check_layout(&backing.layout)?;
        let planner = RowCachePlanner::new(&backing.layout, slots)?;
        let layout = planner.cache_layout().clone();
        let mut cache_state = SparseState::new(*state.optimizer(), &layout)?;
        cache_state.set_step(state.step());
        let mut cache = EmbeddingTables {
            weights: vec![0.0; layout.total_elements()],
            layout,
        };
        // The resident tables start in the cache; the others' rows come per batch.
        let resident = BatchCopies::whole_tables(
            &planner.resident_tables(),
            &backing.layout,
            &cache.layout,
            true,
        );
        copy_elements(&backing.weights, &mut cache.weights, &resident.elements);
        let optimizer = *state.optimizer();
        let (state1_copies, both) = state_copies(&optimizer, &resident);
        let (c1, c2) = cache_state.buffers_mut();
        copy_elements(state.state1(), c1, state1_copies);
        if both {
            copy_elements(state.state2(), c2, &resident.elements);
        }
        let mapped = |values: &[f32]| -> Result<Option<MappedHost>> {
            if values.is_empty() {
                Ok(None)
            } else {
                MappedHost::new(stream, values).map(Some)
            }
        };
        let host = HostRows {
            weights: MappedHost::new(stream, &backing.weights)?,
            state1: mapped(state.state1())?,
            state2: mapped(state.state2())?,
        };
        Ok(DeviceCachedEmbeddingBag {
            device: DeviceEmbeddingBag::new(stream, &cache, &cache_state)?,
            copies: stream
                .alloc_zeros::<u64>(3)
                .map_err(driver("DeviceCachedEmbeddingBag::new"))?,
            backing: backing.layout,
            optimizer,
            host,
            planner,
            traffic: RowCacheReport::default(),
            pending: None,
        })
    }

    /// The cache's tables (the backing ones with `slots[t]` rows each).
    pub fn cache_layout(&self) -> &TableLayout {
        self.planner.cache_layout()
    }

    /// The backing tables' layout.
    pub fn layout(&self) -> &TableLayout {
        &self.backing
    }

    /// Optimizer steps taken.
    pub fn step(&self) -> u64 {
        self.device.step()
    }

    /// Hits, loads, write-backs, bytes moved and the copies' device time so far.
    pub fn report(&mut self) -> Result<RowCacheReport> {
        self.collect_timing()?;
        Ok(RowCacheReport {
            stats: self.planner.stats(),
            ..self.traffic
        })
    }

    /// Adds the device time of the last batch's copies (waits for them if still running).
    fn collect_timing(&mut self) -> Result<()> {
        if let Some((start, end)) = self.pending.take() {
            let ms = start
                .elapsed_ms(&end)
                .map_err(driver("DeviceCachedEmbeddingBag timing"))?;
            self.traffic.copy_seconds += f64::from(ms) / 1e3;
        }
        Ok(())
    }

    /// Runs the copy lists `copies` (already on the device at `at`: elements then rows) one
    /// way, for the weights and each state buffer the rule keeps.
    fn run(
        &mut self,
        stream: &Arc<CudaStream>,
        copies: &RowCopies,
        at: usize,
        direction: Direction,
    ) -> Result<()> {
        let (ne, nr) = (copies.elements.len(), copies.rows.len());
        // Views of exactly 3 n words; an empty list is skipped before any view is made.
        let (elements_at, rows_at) = (at..at + 3 * ne, at + 3 * ne..at + 3 * (ne + nr));
        let (weights, state1, state2) = self.device.buffers_mut();
        let host = &mut self.host;
        let buffers = match self.optimizer {
            SparseOptimizer::Sgd { .. } => {
                [Some((&mut host.weights, weights, &elements_at)), None, None]
            }
            SparseOptimizer::RowWiseAdagrad { .. } => [
                Some((&mut host.weights, weights, &elements_at)),
                host.state1.as_mut().map(|h| (h, state1, &rows_at)),
                None,
            ],
            SparseOptimizer::Adam { .. } => [
                Some((&mut host.weights, weights, &elements_at)),
                host.state1.as_mut().map(|h| (h, state1, &elements_at)),
                host.state2.as_mut().map(|h| (h, state2, &elements_at)),
            ],
        };
        for (host, device, range) in buffers.into_iter().flatten() {
            let n = range.len() / 3;
            if n == 0 {
                continue;
            }
            let list = self.copies.slice(range.clone());
            match direction {
                Direction::ToHost => copy_rows_to_host(stream, device, host, &list, n)?,
                Direction::ToDevice => copy_rows_to_device(stream, host, device, &list, n)?,
            }
        }
        Ok(())
    }

    /// Uploads both directions' lists in one transfer and runs them: write-backs, then loads.
    fn apply(&mut self, stream: &Arc<CudaStream>, copies: &BatchCopies) -> Result<()> {
        if copies.write_backs.is_empty() && copies.loads.is_empty() {
            return Ok(());
        }
        let err = driver("DeviceCachedEmbeddingBag copies");
        let context = stream.context();
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (start, end) = (
            context.new_event(timing).map_err(&err)?,
            context.new_event(timing).map_err(&err)?,
        );
        let lists = [&copies.write_backs, &copies.loads];
        // Each list: its element copies, then its row copies.
        let mut words: Vec<u64> = Vec::new();
        let mut at = [0usize; 2];
        for (i, list) in lists.iter().enumerate() {
            at[i] = words.len();
            words.extend(list.elements.iter().flatten());
            words.extend(list.rows.iter().flatten());
        }
        upload_words(stream, &mut self.copies, &words)?;
        start.record(stream).map_err(&err)?;
        self.run(stream, &copies.write_backs, at[0], Direction::ToHost)?;
        self.run(stream, &copies.loads, at[1], Direction::ToDevice)?;
        end.record(stream).map_err(&err)?;
        self.collect_timing()?;
        self.pending = Some((start, end));
        self.traffic.bytes_to_host += copies.write_backs.bytes(&self.optimizer);
        self.traffic.bytes_to_device += copies.loads.bytes(&self.optimizer);
        Ok(())
    }

    /// Brings the rows of `batch` (ids of the backing tables) into the device cache and
    /// uploads the batch with slot ids; with `training` its rows become dirty.
    pub fn map_batch(
        &mut self,
        stream: &Arc<CudaStream>,
        batch: &JaggedBatch,
        training: bool,
    ) -> Result<DeviceJaggedBatch> {
        let (moves, mapped) = self.planner.map_batch(batch, training)?;
        let copies = BatchCopies::new(&moves, &self.backing, self.planner.cache_layout());
        self.apply(stream, &copies)?;
        DeviceJaggedBatch::upload(stream, self.planner.cache_layout(), &mapped)
    }

    /// The pooled forward of a mapped batch (`[batch, total_dim]`).
    pub fn forward(
        &self,
        stream: &Arc<CudaStream>,
        batch: &DeviceJaggedBatch,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.device.forward(stream, batch, out)
    }

    /// The fused backward + sparse update of a batch mapped with `training`.
    pub fn backward_update(
        &mut self,
        stream: &Arc<CudaStream>,
        batch: &DeviceJaggedBatch,
        dout: &impl DevicePtr<f32>,
    ) -> Result<()> {
        self.device.backward_update(stream, batch, dout)
    }

    /// Changes the learning rate of later steps.
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        self.device.set_lr(lr)
    }

    /// Writes every dirty cached row and the resident tables back to host memory (the rows
    /// stay cached, now clean) and returns the tables' weights and state buffers (empty where
    /// the rule keeps none), current, as host vectors.
    pub fn download(&mut self, stream: &Arc<CudaStream>) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let moves = self.planner.flush();
        let copies = BatchCopies::new(&moves, &self.backing, self.planner.cache_layout());
        self.apply(stream, &copies)?;
        let resident = BatchCopies::whole_tables(
            &self.planner.resident_tables(),
            &self.backing,
            self.planner.cache_layout(),
            false,
        );
        self.copy_whole(stream, &resident)?;
        stream
            .synchronize()
            .map_err(driver("DeviceCachedEmbeddingBag::download"))?;
        let (uses1, uses2) = self.optimizer.state_buffers();
        let read = |h: &Option<MappedHost>, used: bool| -> Result<Vec<f32>> {
            match h {
                Some(h) if used => Ok(h.as_slice()?.to_vec()),
                _ => Ok(Vec::new()),
            }
        };
        let weights = self.host.weights.as_slice()?.to_vec();
        Ok((
            weights,
            read(&self.host.state1, uses1)?,
            read(&self.host.state2, uses2)?,
        ))
    }

    /// Whole-table copies device → host with the driver's copy engine (large, few).
    fn copy_whole(&mut self, stream: &Arc<CudaStream>, copies: &RowCopies) -> Result<()> {
        let err = driver("DeviceCachedEmbeddingBag::download");
        let (state1_list, both) = state_copies(&self.optimizer, copies);
        let state1_list = state1_list.to_vec();
        let (weights, state1, state2) = self.device.buffers_mut();
        let host = &mut self.host;
        let buffers = [
            (
                Some(&mut host.weights),
                &*weights,
                copies.elements.as_slice(),
            ),
            (host.state1.as_mut(), &*state1, state1_list.as_slice()),
            (
                host.state2.as_mut().filter(|_| both),
                &*state2,
                copies.elements.as_slice(),
            ),
        ];
        for (host, device, list) in buffers {
            let Some(host) = host else { continue };
            let host = host.as_mut_slice()?;
            for &[src, dst, len] in list {
                let (src, dst, len) = (src as usize, dst as usize, len as usize);
                stream
                    .memcpy_dtoh(&device.slice(src..src + len), &mut host[dst..dst + len])
                    .map_err(&err)?;
            }
        }
        Ok(())
    }
}
