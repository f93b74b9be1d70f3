use std::sync::RwLock;

#[derive(nitro::ContentHash)]
struct Shared {
    width: usize,
    table: RwLock<Vec<u32>>,
}

fn main() {}
