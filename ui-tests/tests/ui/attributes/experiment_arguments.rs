#[nitro::experiment(foo)]
struct Probe {
    #[graph_const]
    width: usize,
}

fn main() {}
