//! Raw categorical values (Criteo's hex strings, any u64) hashed into a table's row range.

/// SplitMix64's finaliser: a bijection of u64 whose output bits all depend on every input bit,
/// so `value % rows` of the result spreads structured values (consecutive ids, hex strings
/// sharing a prefix) evenly over the table.
pub fn mix64(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The row of `value` in a table of `rows` rows (`rows >= 1`, `rows <= 2^32`).
pub fn hash_to_row(value: u64, rows: usize) -> u32 {
    debug_assert!(rows >= 1 && rows as u64 <= 1 << 32);
    (mix64(value) % rows as u64) as u32
}
