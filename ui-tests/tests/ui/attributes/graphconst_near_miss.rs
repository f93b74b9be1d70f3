#[nitro::experiment]
struct Probe {
    #[graphconst]
    field: usize,
}

fn main() {}
