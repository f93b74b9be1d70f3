#[derive(nitro::Tree)]
union Params {
    w: u32,
}

fn main() {}
