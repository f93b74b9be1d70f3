#[nitro::experiment]
struct Probe(#[graph_const] usize, nitro::Array);

fn main() {}
