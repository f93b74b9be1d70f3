#[nitro::experiment]
enum Probe {
    Small {
        #[graph_const]
        width: usize,
    },
    Large(#[device] nitro::Array),
}

fn main() {}
