//! Exact scalars across a group: 8-byte values are gathered (as two f32 bit patterns each,
//! which the transport copies and never adds) and combined in rank order on every rank, so every
//! rank gets the same bits and takes the same decisions (loss denominators, gradient norms,
//! overflow flags).

use crate::buffer::BufferMut;
use crate::communicator::Communicator;
use crate::error::Result;

/// Every rank's `value`, in rank order.
pub fn gather_words(comm: &dyn Communicator, value: u64) -> Result<Vec<u64>> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut slots = vec![0f32; 2 * world];
    let words: [f32; 2] = bytemuck::cast(value);
    slots[2 * rank..2 * rank + 2].copy_from_slice(&words);
    comm.all_gather(BufferMut::from(&mut slots))?.wait()?;
    Ok(slots
        .chunks_exact(2)
        .map(|w| bytemuck::cast([w[0], w[1]]))
        .collect())
}

/// The sum over the ranks of a count (exact).
pub fn sum_u64(comm: &dyn Communicator, count: u64) -> Result<u64> {
    Ok(gather_words(comm, count)?.into_iter().sum())
}

/// The sum over the ranks of `value`, added in rank order (identical on every rank).
pub fn sum_f64(comm: &dyn Communicator, value: f64) -> Result<f64> {
    Ok(gather_words(comm, value.to_bits())?
        .into_iter()
        .map(f64::from_bits)
        .sum())
}

/// Whether `flag` holds on any rank.
pub fn any(comm: &dyn Communicator, flag: bool) -> Result<bool> {
    Ok(gather_words(comm, u64::from(flag))?.contains(&1))
}
