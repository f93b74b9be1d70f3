use std::cell::RefCell;

#[nitro::experiment]
struct Config {
    #[graph_const]
    value: RefCell<Vec<u8>>,
}

fn main() {}
