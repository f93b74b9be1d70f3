use nitro::Array;

#[nitro::experiment]
struct Probe {
    #[device = "x"]
    field: Array,
}

fn main() {}
