use nitro::Array;

#[nitro::experiment]
struct Probe {
    #[trainable]
    field: Array,
}

fn main() {}
