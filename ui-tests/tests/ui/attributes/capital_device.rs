use nitro::Array;

#[nitro::experiment]
struct Probe {
    #[Device]
    field: Array,
}

fn main() {}
