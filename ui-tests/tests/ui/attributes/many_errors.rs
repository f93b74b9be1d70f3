// Every bad field is reported in one compile, each at its own attribute.
use nitro::Array;

#[nitro::experiment]
struct Probe {
    #[graphconst]
    width: usize,
    #[device(frozen)]
    w: Array,
    #[graph_const]
    #[device]
    b: Array,
    #[host(always)]
    notes: String,
    #[device(trainable)]
    fine: Array,
}

fn main() {}
