//! (in progress) Generates the bindgen FFI for kernels/include/tilearn_kernels.h.
pub fn run(_args: &[String]) -> Result<(), String> {
    Err("build-kernels is not written yet".into())
}
