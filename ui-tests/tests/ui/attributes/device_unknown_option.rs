use nitro::Array;

#[nitro::experiment]
struct Probe {
    #[device(frozen)]
    field: Array,
}

fn main() {}
