// The RefCell is two derived structs down; the error must still name it.
use std::cell::RefCell;

#[derive(nitro::ContentHash)]
struct Inner {
    seen: RefCell<u32>,
}

#[derive(nitro::ContentHash)]
struct Outer {
    width: usize,
    inner: Inner,
}

#[nitro::experiment]
struct Config {
    #[graph_const]
    outer: Outer,
}

fn main() {}
