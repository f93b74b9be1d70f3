#[nitro::experiment]
struct Probe;

fn main() {}
