#[nitro::experiment]
union Probe {
    #[graph_const]
    width: u32,
    scale: f32,
}

fn main() {}
