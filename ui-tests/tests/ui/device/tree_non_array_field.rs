use nitro::Array;

#[derive(nitro::Tree)]
struct Dense {
    w: Array,
    b: Array,
    width: usize,
}

fn main() {}
