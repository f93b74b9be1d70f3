use std::cell::UnsafeCell;

#[derive(nitro::ContentHash)]
enum Norm {
    None,
    Layer { eps: f32 },
    Shared(UnsafeCell<f32>),
}

fn main() {}
