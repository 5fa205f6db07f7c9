fn main() {
    println!("tilearn {}", env!("CARGO_PKG_VERSION"));
}
