#[nitro::experiment]
struct Probe {
    #[host = 1]
    field: Vec<f32>,
}

fn main() {}
