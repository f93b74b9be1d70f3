#[nitro::experiment]
struct Probe {
    #[device(trainable = true)]
    w: nitro::Array,
}

fn main() {}
