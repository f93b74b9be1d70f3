// Trees without leaves: a unit struct and an empty braced struct still have mirrors.
#![deny(warnings)]

#[derive(nitro::Tree)]
pub struct Unit;

#[derive(nitro::Tree)]
pub struct Braced {}

#[derive(nitro::Tree)]
pub struct Holder {
    pub nothing: Unit,
    pub w: nitro::Array,
}

fn main() {
    use nitro::Tree;
    let h = Holder { nothing: Unit, w: nitro::Array::scalar(1.0f32) };
    assert_eq!(h.leaf_count(), 1);
    assert_eq!(Braced {}.leaf_count(), 0);
    let _m: HolderMirror<u8> = h.mirror(&mut nitro::LeafPath::root("h"), &mut |_, _| 0u8);
}
