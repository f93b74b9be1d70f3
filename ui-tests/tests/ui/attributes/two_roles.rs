use nitro::Array;

#[nitro::experiment]
struct Probe {
    #[graph_const]
    #[device]
    field: Array,
}

fn main() {}
