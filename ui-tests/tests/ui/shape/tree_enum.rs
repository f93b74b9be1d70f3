#[derive(nitro::Tree)]
enum Params {
    Dense { w: nitro::Array },
    Empty,
}

fn main() {}
