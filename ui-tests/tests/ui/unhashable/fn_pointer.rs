#[nitro::experiment]
struct Config {
    #[graph_const]
    value: fn(u32) -> u32,
}

fn main() {}
