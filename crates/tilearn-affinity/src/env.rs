//! The launcher's environment contract (torchrun's): `LOCAL_RANK` and `LOCAL_WORLD_SIZE`.

use crate::error::{AffinityError, Result};

/// This process's place among the ranks of its machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRank {
    /// `LOCAL_RANK` (0 when unset).
    pub rank: usize,
    /// `LOCAL_WORLD_SIZE` (1 when unset).
    pub world_size: usize,
}

impl LocalRank {
    /// Reads `LOCAL_RANK` / `LOCAL_WORLD_SIZE` from the environment.
    pub fn from_env() -> Result<LocalRank> {
        let rank = std::env::var("LOCAL_RANK").ok();
        let world = std::env::var("LOCAL_WORLD_SIZE").ok();
        LocalRank::parse(rank.as_deref(), world.as_deref())
    }

    /// Parses the two values (`None` = unset): each a non-negative integer, the world size at
    /// least 1 and above the rank.
    pub fn parse(rank: Option<&str>, world_size: Option<&str>) -> Result<LocalRank> {
        let number = |variable: &'static str, value: Option<&str>, default: usize| match value {
            None => Ok(default),
            Some(text) => text
                .trim()
                .parse::<usize>()
                .map_err(|_| AffinityError::Env {
                    variable,
                    value: text.to_string(),
                    reason: "expected a non-negative integer".into(),
                }),
        };
        let rank_value = number("LOCAL_RANK", rank, 0)?;
        let world = number("LOCAL_WORLD_SIZE", world_size, 1)?;
        if world == 0 {
            return Err(AffinityError::Env {
                variable: "LOCAL_WORLD_SIZE",
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        // LOCAL_RANK alone (LOCAL_WORLD_SIZE unset) still needs room for it.
        let world = if world_size.is_none() {
            world.max(rank_value + 1)
        } else {
            world
        };
        if rank_value >= world {
            return Err(AffinityError::Env {
                variable: "LOCAL_RANK",
                value: rank_value.to_string(),
                reason: format!("must be below LOCAL_WORLD_SIZE ({world})"),
            });
        }
        Ok(LocalRank {
            rank: rank_value,
            world_size: world,
        })
    }
}
