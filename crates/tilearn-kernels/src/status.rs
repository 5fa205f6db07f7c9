//! The text of a launcher's status code, shared by every wrapper crate's error mapping.

use std::ffi::{CStr, c_int};

use crate::ffi;

/// `None` for a successful launch (status 0); otherwise the runtime's name and description of
/// the `cudaError_t` a launcher returned, e.g. `cudaErrorInvalidValue (1): invalid argument`.
pub fn status_message(status: c_int) -> Option<String> {
    if status == 0 {
        return None;
    }
    // SAFETY: both functions only call cudaGetErrorName / cudaGetErrorString, which return
    // pointers to static NUL-terminated strings for every input (an "unrecognized error code"
    // string for unknown values), never NULL.
    let (name, text) = unsafe {
        (
            CStr::from_ptr(ffi::tilearn_status_name(status)),
            CStr::from_ptr(ffi::tilearn_status_string(status)),
        )
    };
    Some(format!(
        "{} ({status}): {}",
        name.to_string_lossy(),
        text.to_string_lossy()
    ))
}
