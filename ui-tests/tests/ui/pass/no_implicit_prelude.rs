// The macros' output names everything by absolute path, so it compiles without the prelude.
#![no_implicit_prelude]
#![deny(warnings)]

extern crate nitro;

#[derive(::nitro::ContentHash)]
struct Arch {
    width: usize,
    names: ::std::vec::Vec<::std::string::String>,
}

#[derive(::nitro::ContentHash)]
enum Act {
    Tanh,
    Scaled(f32),
}

#[derive(::nitro::Tree)]
struct Dense {
    w: ::nitro::Array,
    b: ::std::option::Option<::nitro::Array>,
}

#[::nitro::experiment]
struct Probe<H> {
    #[graph_const]
    arch: Arch,
    #[graph_const]
    act: Act,
    #[device(trainable)]
    layers: ::std::vec::Vec<Dense>,
    #[device]
    lr: ::nitro::Array,
    log: ::std::vec::Vec<H>,
}

fn forward<H>(v: &ProbeView<'_, H>) -> usize {
    v.arch.width + v.layers.len()
}

fn main() {
    let p = Probe::<u8> {
        arch: Arch {
            width: 1,
            names: ::std::vec::Vec::new(),
        },
        act: Act::Scaled(1.0),
        layers: ::std::vec::Vec::new(),
        lr: ::nitro::Array::scalar(0.1f32),
        log: ::std::vec::Vec::new(),
    };
    let _ = (&p.log, Act::Tanh, forward::<u8>);
    let _ = <Probe<u8> as ::nitro::Experiment>::graph_const_digest(&p);
}
