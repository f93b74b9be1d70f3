use nitro::Array;

#[nitro::experiment]
struct Probe {
    #[device]
    #[device]
    field: Array,
}

fn main() {}
