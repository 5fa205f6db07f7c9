//! The per-job token a connection must present to be admitted. It keeps ranks of different jobs
//! (or stray clients) from joining each other by accident; it is not a secret unless the user sets
//! `TILEARN_JOB_TOKEN` to one, and the traffic is not encrypted.

use rand::RngCore;

/// The environment variable that carries the token to every rank.
pub const TOKEN_ENV: &str = "TILEARN_JOB_TOKEN";
/// The longest token accepted in a handshake.
pub const MAX_TOKEN_LEN: usize = 256;

/// A job's admission token.
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken(String);

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobToken(..)")
    }
}

impl JobToken {
    /// A random token (the launcher's, for a single-node job it hosts).
    pub fn random() -> Self {
        let mut bytes = [0u8; 16];
        rand::rng().fill_bytes(&mut bytes);
        JobToken(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// A token every rank of a job derives alike from what they share (master address and port,
    /// run id, world size) when nobody handed them one.
    pub fn derive(parts: &[&str]) -> Self {
        // FNV-1a, twice with different offsets: stable across builds and platforms, unlike std's
        // hasher, so nodes running different builds agree.
        let fnv = |offset: u64| {
            let mut h = offset;
            for part in parts {
                for &b in part.as_bytes().iter().chain(std::iter::once(&0xff)) {
                    h ^= b as u64;
                    h = h.wrapping_mul(0x100_0000_01b3);
                }
            }
            h
        };
        JobToken(format!(
            "derived-{:016x}{:016x}",
            fnv(0xcbf2_9ce4_8422_2325),
            fnv(0x6c62_272e_07bb_0142)
        ))
    }

    /// A token given explicitly (from [`TOKEN_ENV`]); `None` if it is empty or too long.
    pub fn from_value(value: &str) -> Option<Self> {
        (!value.is_empty() && value.len() <= MAX_TOKEN_LEN).then(|| JobToken(value.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Compares with presented bytes in time independent of where they differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let mine = self.0.as_bytes();
        if mine.len() != presented.len() {
            return false;
        }
        mine.iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}
