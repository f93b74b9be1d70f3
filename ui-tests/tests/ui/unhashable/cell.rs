use std::cell::Cell;

#[nitro::experiment]
struct Config {
    #[graph_const]
    value: Cell<u32>,
}

fn main() {}
