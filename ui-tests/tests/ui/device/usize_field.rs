#[nitro::experiment]
struct Probe {
    #[device]
    width: usize,
}

fn main() {}
