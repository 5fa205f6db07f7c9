//! The store's requests and responses and their payload encoding.

use std::time::Duration;

use crate::wire::codec::{Decoder, Encoder};

/// The longest key.
pub const MAX_KEY_LEN: usize = 1024;
/// The largest value.
pub const MAX_VALUE_LEN: usize = 1 << 20;
/// The most keys one `Wait` may name.
pub const MAX_WAIT_KEYS: usize = 1024;
/// The largest store frame: one value plus its key and a few fields.
pub const MAX_STORE_FRAME: usize = MAX_VALUE_LEN + MAX_KEY_LEN + 64;

/// What a client asks the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
    },
    /// Blocks until every key exists or the timeout passes.
    Wait {
        keys: Vec<String>,
        timeout: Duration,
    },
    /// Adds to a counter stored as a decimal string (missing = 0) and returns the new value.
    Add {
        key: String,
        delta: i64,
    },
    /// Sets `desired` if the current value is `expected` (`None`: the key is absent); returns the
    /// value after the call either way.
    CompareSet {
        key: String,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    },
    Delete {
        key: String,
    },
    /// A rank is alive.
    Heartbeat {
        rank: u32,
    },
    /// A rank finished normally and stops sending heartbeats.
    Goodbye {
        rank: u32,
    },
    /// Which ranks have sent a heartbeat but none within `max_age` (and no goodbye).
    Silent {
        max_age: Duration,
    },
}

/// The store's answer to a request (failures travel as `Error` frames).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    Ok,
    Value(Option<Vec<u8>>),
    Int(i64),
    Bool(bool),
    Ranks(Vec<u32>),
    TimedOut,
}

fn key(d: &mut Decoder<'_>) -> Result<String, String> {
    let k = d.str("key")?;
    if k.len() > MAX_KEY_LEN {
        return Err(format!("key of {} bytes is over {MAX_KEY_LEN}", k.len()));
    }
    Ok(k.to_string())
}

fn value(d: &mut Decoder<'_>) -> Result<Vec<u8>, String> {
    let v = d.bytes("value")?;
    if v.len() > MAX_VALUE_LEN {
        return Err(format!(
            "value of {} bytes is over {MAX_VALUE_LEN}",
            v.len()
        ));
    }
    Ok(v.to_vec())
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Request::Set { key, value } => Encoder::new().u8(1).str(key).bytes(value),
            Request::Get { key } => Encoder::new().u8(2).str(key),
            Request::Wait { keys, timeout } => keys.iter().fold(
                Encoder::new()
                    .u8(3)
                    .u64(timeout.as_millis() as u64)
                    .u32(keys.len() as u32),
                |e, k| e.str(k),
            ),
            Request::Add { key, delta } => Encoder::new().u8(4).str(key).i64(*delta),
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                let e = Encoder::new().u8(5).str(key);
                let e = match expected {
                    Some(v) => e.u8(1).bytes(v),
                    None => e.u8(0),
                };
                e.bytes(desired)
            }
            Request::Delete { key } => Encoder::new().u8(6).str(key),
            Request::Heartbeat { rank } => Encoder::new().u8(7).u32(*rank),
            Request::Goodbye { rank } => Encoder::new().u8(8).u32(*rank),
            Request::Silent { max_age } => Encoder::new().u8(9).u64(max_age.as_millis() as u64),
        }
        .finish()
    }

    pub fn decode(payload: &[u8]) -> Result<Request, String> {
        let mut d = Decoder::new(payload);
        let request = match d.u8("request type")? {
            1 => Request::Set {
                key: key(&mut d)?,
                value: value(&mut d)?,
            },
            2 => Request::Get { key: key(&mut d)? },
            3 => {
                let timeout = Duration::from_millis(d.u64("timeout")?);
                let n = d.u32("key count")? as usize;
                if n > MAX_WAIT_KEYS {
                    return Err(format!("wait on {n} keys is over {MAX_WAIT_KEYS}"));
                }
                let keys = (0..n).map(|_| key(&mut d)).collect::<Result<_, _>>()?;
                Request::Wait { keys, timeout }
            }
            4 => Request::Add {
                key: key(&mut d)?,
                delta: d.i64("delta")?,
            },
            5 => {
                let key = key(&mut d)?;
                let expected = match d.u8("expected flag")? {
                    0 => None,
                    1 => Some(value(&mut d)?),
                    other => return Err(format!("expected flag {other} is neither 0 nor 1")),
                };
                Request::CompareSet {
                    key,
                    expected,
                    desired: value(&mut d)?,
                }
            }
            6 => Request::Delete { key: key(&mut d)? },
            7 => Request::Heartbeat {
                rank: d.u32("rank")?,
            },
            8 => Request::Goodbye {
                rank: d.u32("rank")?,
            },
            9 => Request::Silent {
                max_age: Duration::from_millis(d.u64("max age")?),
            },
            other => return Err(format!("unknown request type {other}")),
        };
        d.finish()?;
        Ok(request)
    }
}

impl Response {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Response::Ok => Encoder::new().u8(1),
            Response::Value(None) => Encoder::new().u8(2).u8(0),
            Response::Value(Some(v)) => Encoder::new().u8(2).u8(1).bytes(v),
            Response::Int(i) => Encoder::new().u8(3).i64(*i),
            Response::Bool(b) => Encoder::new().u8(4).u8(*b as u8),
            Response::Ranks(ranks) => ranks
                .iter()
                .fold(Encoder::new().u8(5).u32(ranks.len() as u32), |e, &r| {
                    e.u32(r)
                }),
            Response::TimedOut => Encoder::new().u8(6),
        }
        .finish()
    }

    pub fn decode(payload: &[u8]) -> Result<Response, String> {
        let mut d = Decoder::new(payload);
        let response = match d.u8("response type")? {
            1 => Response::Ok,
            2 => match d.u8("value flag")? {
                0 => Response::Value(None),
                1 => Response::Value(Some(value(&mut d)?)),
                other => return Err(format!("value flag {other} is neither 0 nor 1")),
            },
            3 => Response::Int(d.i64("int")?),
            4 => Response::Bool(d.u8("bool")? != 0),
            5 => {
                let n = d.u32("rank count")? as usize;
                // Each rank takes 4 bytes, so a lying count fails on truncation, not allocation.
                let ranks = (0..n).map(|_| d.u32("rank")).collect::<Result<_, _>>()?;
                Response::Ranks(ranks)
            }
            6 => Response::TimedOut,
            other => return Err(format!("unknown response type {other}")),
        };
        d.finish()?;
        Ok(response)
    }
}
