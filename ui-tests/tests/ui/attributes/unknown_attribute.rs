// An attribute that is not close to a marker is left for rustc, which reports it once.
#[nitro::experiment]
struct Probe {
    #[frozen]
    w: nitro::Array,
}

fn main() {}
