//! TensorBoard's event file: TFRecord framing around serialized `tensorflow.Event` protobufs.
//!
//! Each record is `u64 length (LE) · masked crc32c(length) · data · masked crc32c(data)`; the
//! data is an `Event` (`tensorflow/core/util/event.proto`). Only the fields tilearn writes are
//! declared: prost skips the rest when reading. The first event of a file carries
//! `file_version: "brain.Event:2"`, which readers check to know the format.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

use crate::{EngineError, Result};

/// The version string TensorBoard expects in the first event of a file.
pub const FILE_VERSION: &str = "brain.Event:2";

/// `tensorflow.Event`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "What", tags = "3, 5, 7")]
    pub what: Option<What>,
}

/// The `what` oneof of `tensorflow.Event` (the kinds tilearn writes).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with a `simple_value` (a scalar).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
}

/// `tensorflow.SummaryMetadata`: TensorBoard shows the description beside the chart.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
    #[prost(string, tag = "3")]
    pub summary_description: String,
}

/// `tensorflow.SummaryMetadata.PluginData`: which TensorBoard plugin owns the tag.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
}

/// The scalars dashboard's plugin name.
pub const SCALARS_PLUGIN: &str = "scalars";

/// `tensorflow.SessionLog`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionLog {
    /// 1 = START: readers drop the events of this run at or after the event's step, which is
    /// how a resumed run replaces what the first attempt logged past its checkpoint.
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// `SessionLog.SessionStatus.START`.
pub const SESSION_START: i32 = 1;

/// crc32c as TFRecord stores it: rotated and offset, so a CRC of data that holds CRCs is not
/// degenerate.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One event as a complete TFRecord.
fn frame(event: &Event) -> Vec<u8> {
    let data = event.encode_to_vec();
    let length = (data.len() as u64).to_le_bytes();
    let mut record = Vec::with_capacity(data.len() + 16);
    record.extend_from_slice(&length);
    record.extend_from_slice(&masked_crc(&length).to_le_bytes());
    record.extend_from_slice(&data);
    record.extend_from_slice(&masked_crc(&data).to_le_bytes());
    record
}

/// Seconds since the Unix epoch, as `Event.wall_time` holds it.
pub fn wall_time_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Appends events to one file, each in one `write` so a crashed run keeps every complete
/// event (no user-space buffer holds any back).
pub struct EventFile {
    path: PathBuf,
    file: File,
}

impl EventFile {
    /// Creates `path` and writes the `file_version` event.
    pub fn create(path: &Path) -> Result<EventFile> {
        let file =
            File::create(path).map_err(|e| EngineError::io(path, "create the event file", e))?;
        let mut events = EventFile {
            path: path.to_path_buf(),
            file,
        };
        events.write(&Event {
            wall_time: wall_time_now(),
            step: 0,
            what: Some(What::FileVersion(FILE_VERSION.into())),
        })?;
        Ok(events)
    }

    pub fn write(&mut self, event: &Event) -> Result<()> {
        self.file
            .write_all(&frame(event))
            .and_then(|_| self.file.flush())
            .map_err(|e| EngineError::io(&self.path, "write the TensorBoard event file", e))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every event of a file back, checking both CRCs of each record and that the first
/// event is the `file_version` one; errors name the file and the byte offset.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let bytes = std::fs::read(path).map_err(|e| EngineError::io(path, "read the event file", e))?;
    let bad = |offset: usize, message: &str| EngineError::Data {
        file: path.to_path_buf(),
        message: format!("byte {offset}: {message}"),
    };
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let mut events = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        if bytes.len() - at < 12 {
            return Err(bad(at, "truncated record header"));
        }
        let length_bytes = &bytes[at..at + 8];
        if u32_at(at + 8) != masked_crc(length_bytes) {
            return Err(bad(at, "length CRC mismatch"));
        }
        let length = u64::from_le_bytes(length_bytes.try_into().expect("8 bytes"));
        let start = at + 12;
        let end = usize::try_from(length)
            .ok()
            .and_then(|n| start.checked_add(n))
            .filter(|&end| end + 4 <= bytes.len())
            .ok_or_else(|| bad(at, "truncated record data"))?;
        let data = &bytes[start..end];
        if u32_at(end) != masked_crc(data) {
            return Err(bad(at, "data CRC mismatch"));
        }
        let event = Event::decode(data).map_err(|e| bad(at, &format!("not an Event: {e}")))?;
        if events.is_empty() && event.what != Some(What::FileVersion(FILE_VERSION.into())) {
            return Err(bad(
                at,
                "the first event is not file_version \"brain.Event:2\"",
            ));
        }
        events.push(event);
        at = end + 4;
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorboard() {
        // Expected values from TensorBoard 2.21's own writer:
        // `tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c`.
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
        assert_eq!(masked_crc(&[0u8; 8]), 0x0798_0329);
    }

    #[test]
    fn events_read_back_and_corruption_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.out.tfevents.test");
        let mut file = EventFile::create(&path).unwrap();
        let scalar = Event {
            wall_time: 1.5,
            step: 7,
            what: Some(What::Summary(Summary {
                value: vec![SummaryValue {
                    tag: "train/loss".into(),
                    simple_value: Some(2.25),
                    metadata: None,
                }],
            })),
        };
        file.write(&scalar).unwrap();
        let events = read_events(&path).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[1], scalar);

        // Flip one bit of the last record's data: its data CRC no longer matches.
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = read_events(&path).unwrap_err().to_string();
        assert!(err.contains("data CRC mismatch"), "{err}");
        assert!(err.contains("events.out.tfevents.test"), "{err}");
    }
}
