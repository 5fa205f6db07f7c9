//! Messages of any length between every pair of ranks, from the communicator's equal-shard
//! `all_to_all`: the lengths go first (one all_to_all of one value per peer), the longest is
//! agreed on (an all_reduce max), then every message travels padded to it. u32 payloads travel
//! bit-cast in f32 slots: all_to_all only moves bytes, so every bit pattern arrives intact.

use tilearn_parallel::{Communicator, ReduceOp};

use crate::error::{RecsysError, Result};

fn comm_error(what: &'static str) -> impl Fn(tilearn_parallel::ParallelError) -> RecsysError {
    move |e| RecsysError::invalid(what, e.to_string())
}

/// Sends `messages[d]` to rank `d` and returns what each rank sent to this one, in rank order.
pub fn exchange_f32(comm: &dyn Communicator, messages: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
    let world = comm.world_size();
    if messages.len() != world {
        return Err(RecsysError::invalid(
            "sharded exchange",
            format!("{} messages for {world} ranks", messages.len()),
        ));
    }
    let err = comm_error("sharded exchange");
    // Lengths, exact as f32 below 2^24 elements per message.
    let longest_here = messages.iter().map(Vec::len).max().unwrap_or(0);
    if longest_here >= 1 << 24 {
        return Err(RecsysError::invalid(
            "sharded exchange",
            format!("a message of {longest_here} values; at most 2^24 - 1 per peer"),
        ));
    }
    let mut lens: Vec<f32> = messages.iter().map(|m| m.len() as f32).collect();
    comm.all_to_all((&mut lens).into())
        .map_err(&err)?
        .wait()
        .map_err(&err)?;
    let mut longest = [longest_here as f32];
    (comm.all_reduce((&mut longest[..]).into(), ReduceOp::Max))
        .map_err(&err)?
        .wait()
        .map_err(&err)?;
    let slot = longest[0] as usize;
    if slot == 0 {
        return Ok(vec![Vec::new(); world]);
    }
    let mut buf = vec![0.0f32; slot * world];
    for (d, m) in messages.iter().enumerate() {
        buf[d * slot..d * slot + m.len()].copy_from_slice(m);
    }
    comm.all_to_all((&mut buf).into())
        .map_err(&err)?
        .wait()
        .map_err(&err)?;
    Ok((0..world)
        .map(|s| buf[s * slot..s * slot + lens[s] as usize].to_vec())
        .collect())
}

/// [`exchange_f32`] of u32 messages.
pub fn exchange_u32(comm: &dyn Communicator, messages: &[Vec<u32>]) -> Result<Vec<Vec<u32>>> {
    let as_f32: Vec<Vec<f32>> = (messages.iter())
        .map(|m| m.iter().map(|&x| f32::from_bits(x)).collect())
        .collect();
    Ok(exchange_f32(comm, &as_f32)?
        .into_iter()
        .map(|m| m.into_iter().map(f32::to_bits).collect())
        .collect())
}

/// `x` as three f32 whose f64 sum is `x` exactly (24 + 24 + 24 bits cover f64's 53; values
/// within f32's exponent range, as loss sums are): an f64 crosses an f32-only all-reduce this
/// way, summed part by part. With one rank the round trip is the identity.
pub fn split_f64(x: f64) -> [f32; 3] {
    let high = x as f32;
    let rest = x - f64::from(high);
    let mid = rest as f32;
    [high, mid, (rest - f64::from(mid)) as f32]
}

/// The f64 of three parts from [`split_f64`] (or their sums over ranks).
pub fn join_f64(parts: [f32; 3]) -> f64 {
    f64::from(parts[0]) + f64::from(parts[1]) + f64::from(parts[2])
}

#[cfg(test)]
mod tests {
    use super::{join_f64, split_f64};

    /// Values with all 53 bits in use (square roots, thirds), of several magnitudes and
    /// signs, as loss sums of batches are.
    #[test]
    fn an_f64_survives_three_f32_parts_exactly() {
        let values = (1..2000).map(|i| {
            let x = f64::from(i).sqrt() / 3.0 * 10f64.powi(i % 13 - 6);
            if i % 2 == 0 { x } else { -x }
        });
        for x in values.chain([0.0, 1.0 / 3.0]) {
            assert_eq!(join_f64(split_f64(x)).to_bits(), x.to_bits(), "{x}");
        }
    }
}
