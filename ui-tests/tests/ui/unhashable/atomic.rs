use std::sync::atomic::AtomicUsize;

#[nitro::experiment]
struct Config {
    #[graph_const]
    value: AtomicUsize,
}

fn main() {}
