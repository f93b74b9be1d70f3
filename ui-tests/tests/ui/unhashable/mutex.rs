use std::sync::Mutex;

#[nitro::experiment]
struct Config {
    #[graph_const]
    value: Mutex<u32>,
}

fn main() {}
