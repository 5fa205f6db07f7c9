//! (in progress)
pub fn run(_args: &[String]) -> Result<(), String> {
    Err("test is not written yet".into())
}
