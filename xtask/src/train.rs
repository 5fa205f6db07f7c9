//! (in progress)
pub fn run(_args: &[String]) -> Result<(), String> {
    Err("train is not written yet".into())
}
