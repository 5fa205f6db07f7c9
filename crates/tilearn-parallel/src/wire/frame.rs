//! The frame every tilearn socket speaks (store and host communicator alike):
//! `"TLRN" | version u8 | kind u8 | reserved u16 = 0 | payload length u32 LE | payload`.
//! The reader checks each header field before it reads or allocates anything, so a foreign or
//! malformed stream yields an error, never a huge allocation, a panic or an unbounded read.

use std::io::{self, Read, Write};

/// The first bytes of every frame.
pub const MAGIC: [u8; 4] = *b"TLRN";
/// The protocol version; a peer speaking another one is refused.
pub const VERSION: u8 = 1;
/// Header bytes before the payload.
pub const HEADER_LEN: usize = 12;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// First frame of a connection: who is connecting, with the job token.
    Hello = 1,
    /// The handshake was accepted.
    Welcome = 2,
    /// A refusal or a failed request; the payload is a UTF-8 message.
    Error = 3,
    /// A store request.
    Request = 4,
    /// A store response.
    Response = 5,
    /// A piece of a collective or a send/recv: tag then elements.
    Data = 6,
}

impl FrameKind {
    fn from_byte(byte: u8) -> Option<FrameKind> {
        Some(match byte {
            1 => FrameKind::Hello,
            2 => FrameKind::Welcome,
            3 => FrameKind::Error,
            4 => FrameKind::Request,
            5 => FrameKind::Response,
            6 => FrameKind::Data,
            _ => return None,
        })
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
pub enum FrameError {
    Io(io::Error),
    Malformed(String),
    TooLarge { len: u64, max: u64 },
}

impl From<io::Error> for FrameError {
    fn from(e: io::Error) -> Self {
        FrameError::Io(e)
    }
}

/// A parsed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub len: usize,
}

/// A whole frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub payload: Vec<u8>,
}

/// Parses a header, refusing a payload longer than `max_len`.
pub fn parse_header(bytes: &[u8; HEADER_LEN], max_len: usize) -> Result<FrameHeader, FrameError> {
    if bytes[..4] != MAGIC {
        return Err(FrameError::Malformed(format!(
            "bad magic {:02x?} (not a tilearn peer)",
            &bytes[..4]
        )));
    }
    if bytes[4] != VERSION {
        return Err(FrameError::Malformed(format!(
            "protocol version {} (this build speaks {VERSION})",
            bytes[4]
        )));
    }
    let kind = FrameKind::from_byte(bytes[5])
        .ok_or_else(|| FrameError::Malformed(format!("unknown frame kind {}", bytes[5])))?;
    if bytes[6..8] != [0, 0] {
        return Err(FrameError::Malformed(
            "reserved header bytes are not zero".into(),
        ));
    }
    let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as u64;
    if len > max_len as u64 {
        return Err(FrameError::TooLarge {
            len,
            max: max_len as u64,
        });
    }
    Ok(FrameHeader {
        kind,
        len: len as usize,
    })
}

/// Reads and checks one header.
pub fn read_header(reader: &mut impl Read, max_len: usize) -> Result<FrameHeader, FrameError> {
    let mut bytes = [0u8; HEADER_LEN];
    reader.read_exact(&mut bytes)?;
    parse_header(&bytes, max_len)
}

/// Reads one frame whose payload is at most `max_len` bytes.
pub fn read_frame(reader: &mut impl Read, max_len: usize) -> Result<Frame, FrameError> {
    let header = read_header(reader, max_len)?;
    let mut payload = vec![0u8; header.len];
    reader.read_exact(&mut payload)?;
    Ok(Frame {
        kind: header.kind,
        payload,
    })
}

/// The header of a frame of `kind` whose payload is `len` bytes.
pub fn header(kind: FrameKind, len: usize) -> io::Result<[u8; HEADER_LEN]> {
    let len = u32::try_from(len).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("frame payload of {len} bytes does not fit a u32 length"),
        )
    })?;
    let mut bytes = [0u8; HEADER_LEN];
    bytes[..4].copy_from_slice(&MAGIC);
    bytes[4] = VERSION;
    bytes[5] = kind as u8;
    bytes[8..].copy_from_slice(&len.to_le_bytes());
    Ok(bytes)
}

/// Writes one frame whose payload is the concatenation of `parts` (no copy of large parts).
pub fn write_frame(writer: &mut impl Write, kind: FrameKind, parts: &[&[u8]]) -> io::Result<()> {
    let len = parts.iter().map(|p| p.len()).sum();
    writer.write_all(&header(kind, len)?)?;
    for part in parts {
        writer.write_all(part)?;
    }
    writer.flush()
}
