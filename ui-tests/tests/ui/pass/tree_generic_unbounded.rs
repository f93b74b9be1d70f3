// A generic Tree struct needs no `T: Tree` bound of its own: the derive adds it.
use nitro::Array;

#[derive(nitro::Tree)]
struct Layer<T> {
    inner: T,
    bias: Array,
}

fn main() {}

#[allow(dead_code)]
fn check() {
    fn is_tree<T: nitro::Tree>() {}
    is_tree::<Layer<Array>>();
    is_tree::<Layer<Vec<Array>>>();
}
