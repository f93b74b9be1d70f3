// In the style of serde's test_gen.rs: the macros' output must compile cleanly, without warnings,
// in a scope where common std and nitro names mean something else.
#![deny(warnings)]
#![allow(non_camel_case_types)]

// Local items shadowing std prelude names and the names generated code might reach for.
type Result = ();
struct Option;
struct Some;
struct None;
struct Ok;
struct Err;
struct Vec;
struct String;
struct Box;
struct Clone;
struct Copy;
struct Debug;
struct Default;
struct Drop;
struct Fn;
struct FnMut;
struct Iterator;
struct Into;
struct PhantomData;
struct Sized;
struct Send;
// nitro's own names.
struct ContentHash;
struct ContentHasher;
struct Tree;
struct Array;
struct Tensor;
struct Digest;
struct LeafPath;
struct Node;
struct FieldInfo;
struct Role;
struct Experiment;
// Crate and module names the generated code must reach through `::`.
mod core {}
mod std {}
mod nitro {}
mod __private {}

#[derive(::nitro::ContentHash)]
struct Arch {
    width: usize,
    flags: ::std::vec::Vec<bool>,
    name: ::std::string::String,
    act: Act,
}

#[derive(::nitro::ContentHash)]
enum Act {
    Tanh,
    Scaled(f32),
    Gated { gate: ::std::option::Option<f32> },
}

#[derive(::nitro::Tree)]
struct Dense {
    w: ::nitro::Array,
    b: ::std::option::Option<::nitro::Array>,
}

#[derive(::nitro::Tree)]
struct Pair<T: ::nitro::Tree>(T, ::nitro::Array);

#[::nitro::experiment]
struct Probe<T: ::nitro::Tree> {
    #[graph_const]
    arch: Arch,
    #[device(trainable)]
    layers: ::std::vec::Vec<Dense>,
    #[device]
    pair: Pair<T>,
    notes: ::std::string::String,
}

fn forward<T: ::nitro::Tree>(v: &ProbeView<'_, T>) -> usize {
    v.arch.width + v.layers.len()
}

fn main() {
    let _: Result = ();
    let _ = (
        Option, Some, None, Ok, Err, Vec, String, Box, Clone, Copy, Debug, Default,
    );
    let _ = (Drop, Fn, FnMut, Iterator, Into, PhantomData, Sized, Send);
    let _ = (
        ContentHash,
        ContentHasher,
        Tree,
        Array,
        Tensor,
        Digest,
        LeafPath,
        Node,
        FieldInfo,
    );
    let _ = (Role, Experiment);
    let p = Probe::<::nitro::Array> {
        arch: Arch {
            width: 1,
            flags: ::std::vec::Vec::new(),
            name: ::std::string::String::new(),
            act: Act::Tanh,
        },
        layers: ::std::vec::Vec::new(),
        pair: Pair(
            ::nitro::Array::scalar(1.0f32),
            ::nitro::Array::scalar(2.0f32),
        ),
        notes: ::std::string::String::new(),
    };
    let _ = (
        &p.notes,
        &p.arch.flags,
        &p.arch.name,
        Act::Scaled(1.0),
        Act::Gated {
            gate: ::std::option::Option::None,
        },
    );
    let _ = forward::<::nitro::Array>;
    let _ = <Probe<::nitro::Array> as ::nitro::Experiment>::graph_const_digest(&p);
    let _ = <Dense as ::nitro::Tree>::leaf_count(&Dense {
        w: ::nitro::Array::scalar(0i32),
        b: ::std::option::Option::None,
    });
}
