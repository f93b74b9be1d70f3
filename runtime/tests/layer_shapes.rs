//! Layer shapes (issue 50, item 16): a layer whose heads do not divide its width is refused
//! when it is built, naming the numbers; one written as a literal is refused by its forward
//! pass at the caller's line; and a shape error raised inside a layer's call names the line
//! that called the layer, not a line of nitro's own source.
#![allow(missing_docs)]

use nitro::nn::{
    self, AttentionParamsMirror, Gpt2, Layer, LinearParamsMirror, MultiHeadAttention, Repeated,
    TransformerBlock,
};
use nitro::prelude::*;
use nitro::trace::trace;
use nitro::{Error, LeafType};

fn f32s(dims: &[usize]) -> LeafType {
    LeafType::new(DType::F32, dims)
}

/// The inputs of an attention of width `d`: `x`, then `w` and `b` of q, k, v and o.
fn attention_inputs(x: &[usize], d: usize) -> Vec<(String, LeafType)> {
    let mut inputs = vec![("x".to_owned(), f32s(x))];
    for name in ["q", "k", "v", "o"] {
        inputs.push((format!("{name}.w"), f32s(&[d, d])));
        inputs.push((format!("{name}.b"), f32s(&[d])));
    }
    inputs
}

fn attention_params(t: &[Tensor]) -> AttentionParamsMirror<Tensor> {
    let lin = |k: usize| LinearParamsMirror {
        w: t[1 + 2 * k],
        b: Some(t[2 + 2 * k]),
    };
    AttentionParamsMirror {
        q: lin(0),
        k: lin(1),
        v: lin(2),
        o: lin(3),
    }
}

/// This file's location at `line`, as a trace error names it.
fn here(line: u32) -> String {
    format!("{}:{line}:", file!())
}

#[test]
fn a_block_whose_heads_do_not_divide_its_width_is_refused_when_built() {
    let err = TransformerBlock::causal(512, 7).unwrap_err();
    assert!(matches!(err, Error::LayerShape { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("TransformerBlock::causal(512, 7)")
            && msg.contains("7 heads do not divide the width 512")
            && msg.contains("511 or 518"),
        "{msg}"
    );
    assert!(TransformerBlock::causal(512, 8).is_ok());
    let err = TransformerBlock::causal(64, 0).unwrap_err().to_string();
    assert!(err.contains("0 heads"), "{err}");
}

#[test]
fn attention_and_gpt2_are_refused_the_same_way() {
    let err = MultiHeadAttention::new(96, 5, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("MultiHeadAttention::new(96, 5, false)") && err.contains("5 heads"),
        "{err}"
    );
    let err = Gpt2::new(50, 16, 64, 5, 2).unwrap_err().to_string();
    assert!(
        err.contains("Gpt2::new(50, 16, 64, 5, 2)") && err.contains("do not divide the width 64"),
        "{err}"
    );
    assert!(Gpt2::new(50, 16, 64, 4, 2).is_ok());
}

/// A literal that skipped the constructor is refused by the forward pass, naming the numbers
/// and the line that called it (before: a `reshape` error inside `nn/mod.rs`).
#[test]
fn an_attention_literal_with_bad_heads_is_refused_at_the_callers_line() {
    let mha = MultiHeadAttention {
        dim: 8,
        heads: 3,
        causal: true,
    };
    let mut line = 0;
    let err = trace(&attention_inputs(&[2, 4, 8], 8), |t| {
        line = line!() + 1;
        vec![mha.forward(&attention_params(t), t[0])]
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("3 heads do not divide the width 8"), "{err}");
    assert!(err.contains(&here(line)), "{err} (want {})", here(line));
    assert!(!err.contains("src/nn"), "{err}");
}

/// A shape error raised inside an attention's call (the input is 6 wide, the layer 8): the
/// projection fails inside the layer, and the error names this file's line.
#[test]
fn a_shape_error_inside_attention_names_the_callers_line() {
    let mha = MultiHeadAttention::new(8, 2, true).unwrap();
    let mut inputs = attention_inputs(&[2, 4, 6], 8);
    inputs[0].1 = f32s(&[2, 4, 6]);
    let mut line = 0;
    let err = trace(&inputs, |t| {
        line = line!() + 1;
        vec![mha.forward(&attention_params(t), t[0])]
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("matmul"), "{err}");
    assert!(err.contains(&here(line)), "{err} (want {})", here(line));
    assert!(!err.contains("src/nn"), "{err}");
}

/// The same inside a scanned stack (the layer runs in the scan's body, a closure of the
/// library's) and inside a transformer block's norm.
#[test]
fn a_shape_error_inside_a_scanned_stack_names_the_callers_line() {
    let stack = Repeated::new(nn::Linear::new(4, 4), 3);
    let inputs = vec![
        ("x".to_owned(), f32s(&[2, 5])),
        ("w".to_owned(), f32s(&[3, 4, 4])),
        ("b".to_owned(), f32s(&[3, 4])),
    ];
    let mut line = 0;
    let err = trace(&inputs, |t| {
        let p = LinearParamsMirror {
            w: t[1],
            b: Some(t[2]),
        };
        line = line!() + 1;
        vec![stack.forward(&p, t[0])]
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains(&here(line)), "{err} (want {})", here(line));
    assert!(!err.contains("src/nn"), "{err}");
}

/// Errors in the user's own code keep their own lines: a closure given to `nn::stack` is the
/// user's, so its error names the closure's line, not the `stack` call.
#[test]
fn an_error_in_the_users_own_closure_keeps_its_line() {
    let layers = [nn::Linear::new(4, 4)];
    let inputs = vec![
        ("x".to_owned(), f32s(&[2, 4])),
        ("w".to_owned(), f32s(&[4, 4])),
        ("b".to_owned(), f32s(&[4])),
    ];
    let mut line = 0;
    let err = trace(&inputs, |t| {
        let p = vec![
            LinearParamsMirror {
                w: t[1],
                b: Some(t[2]),
            };
            2
        ];
        let layers = [layers[0], layers[0]];
        line = line!() + 1;
        let bad = |h: Tensor| h.reshape(&[3, 3]);
        vec![nn::stack(&layers, &p, t[0], bad)]
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("reshape"), "{err}");
    assert!(err.contains(&here(line)), "{err} (want {})", here(line));
}
