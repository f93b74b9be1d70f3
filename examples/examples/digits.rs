//! The digits experiment: declares it, loads the data and prints its compile key.
//!
//! `cargo run -p nitro-examples --example digits` (from the workspace root).

use nitro::Experiment;
use nitro_examples::{data, glorot, Activation, Arch, DigitsMlp};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let data = data::Digits::load(data::DIGITS_PATH)?;
    println!(
        "data set: {} rows, digest {}",
        data.rows(),
        data.digest.short()
    );

    let arch = Arch {
        widths: vec![64, 128, 10],
        activation: Activation::Tanh,
    };
    let exp = DigitsMlp {
        layers: glorot(&arch.widths, 1),
        arch,
        lr: nitro::Array::scalar(0.1f32),
        data,
    };

    print!("{}", DigitsMlp::key_manifest());
    println!("GraphConst digest: {}", exp.graph_const_digest());
    for (field, digest) in exp.graph_const_field_digests() {
        println!("  {field}: {}", digest.short());
    }
    println!("Device signature:  {}", exp.device_signature());

    // What moves the key, and what does not.
    let relu = Arch {
        activation: Activation::Relu,
        ..exp.arch.clone()
    };
    let relu_digest = DigitsMlp {
        arch: relu,
        ..exp.clone()
    }
    .graph_const_digest();
    println!(
        "changing the activation moves the key: {} -> {}",
        exp.graph_const_digest().short(),
        relu_digest.short()
    );
    let mut new_lr = exp.clone();
    new_lr.lr = nitro::Array::scalar(0.01f32);
    println!(
        "changing the learning rate keeps it:   {} == {}: {}",
        exp.graph_const_digest().short(),
        new_lr.graph_const_digest().short(),
        exp.graph_const_digest() == new_lr.graph_const_digest()
            && exp.device_signature() == new_lr.device_signature()
    );
    Ok(())
}
