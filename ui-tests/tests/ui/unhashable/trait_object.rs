#[nitro::experiment]
struct Config {
    #[graph_const]
    value: Box<dyn std::fmt::Debug>,
}

fn main() {}
