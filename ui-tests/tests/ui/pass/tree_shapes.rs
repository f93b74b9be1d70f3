// #[derive(Tree)] on tuple, generic and bounded structs; the mirror keeps the shape.
#![deny(warnings)]

use nitro::{Array, DType, LeafPath, Tree};

#[derive(Tree)]
pub struct Pair(pub Array, pub Array);

#[derive(Tree)]
pub struct Layer<T: nitro::Tree> {
    pub inner: T,
    pub bias: Array,
}

// A parameter named `L` must not clash with the mirror's leaf parameter.
#[derive(Tree)]
pub struct Stack<L>
where
    L: Tree,
{
    pub layers: Vec<L>,
}

#[derive(Tree)]
pub struct Fixed<const N: usize> {
    pub blocks: [Array; N],
}

fn main() {
    let a = || Array::zeros(DType::F32, &[2]);
    let stack = Stack {
        layers: vec![Layer {
            inner: Pair(a(), a()),
            bias: a(),
        }],
    };
    let m: StackMirror<usize, Layer<Pair>> =
        stack.mirror(&mut LeafPath::root("s"), &mut |_, x| x.len());
    assert_eq!((m.layers[0].inner.0, m.layers[0].bias), (2, 2));
    let _copy: StackMirror<usize, Layer<Pair>> = m.clone();
    let _ = format!("{m:?}");
    assert_eq!(stack.leaf_count(), 3);
    let fixed = Fixed {
        blocks: [a(), a(), a()],
    };
    assert_eq!(fixed.leaf_count(), 3);
    let _: PairMirror<u8> = PairMirror(1, 2);
    let _: LayerMirror<u8, Pair> = LayerMirror {
        inner: PairMirror(1, 2),
        bias: 3,
    };
    let _: FixedMirror<u8, 3> = FixedMirror { blocks: [0; 3] };
}
