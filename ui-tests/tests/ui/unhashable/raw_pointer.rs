#[nitro::experiment]
struct Config {
    #[graph_const]
    value: *const u8,
}

fn main() {}
