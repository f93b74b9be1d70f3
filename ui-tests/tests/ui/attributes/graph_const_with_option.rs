#[nitro::experiment]
struct Probe {
    #[graph_const(x)]
    field: usize,
}

fn main() {}
