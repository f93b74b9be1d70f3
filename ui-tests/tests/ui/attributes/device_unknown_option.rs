use nitro::Array;

#[nitro::experiment]
struct Probe {
    #[device(sharded)]
    field: Array,
}

fn main() {}
