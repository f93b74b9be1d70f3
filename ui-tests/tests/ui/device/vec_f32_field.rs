#[nitro::experiment]
struct Probe {
    #[device(trainable)]
    weights: Vec<f32>,
}

fn main() {}
