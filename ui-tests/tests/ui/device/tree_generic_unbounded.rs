// A generic Tree struct must bound its parameter: the mirror names `<T as Tree>::Mirror<L>`.
use nitro::Array;

#[derive(nitro::Tree)]
struct Layer<T> {
    inner: T,
    bias: Array,
}

fn main() {}
