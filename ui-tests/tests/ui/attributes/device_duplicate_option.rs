use nitro::Array;

#[nitro::experiment]
struct Probe {
    #[device(trainable, trainable)]
    field: Array,
}

fn main() {}
