#[derive(nitro::ContentHash)]
union Bits {
    int: u32,
    float: f32,
}

fn main() {}
