// Experiments at the edges: no fields, only Host fields, a defaulted parameter, a raw identifier.
#![deny(warnings)]

use nitro::prelude::*;

#[experiment]
pub struct Nothing {}

#[experiment]
pub struct HostOnly {
    pub data: Vec<f32>,
    #[host]
    pub name: String,
}

#[experiment]
pub struct Defaulted<H = ()> {
    #[graph_const]
    pub r#type: usize,
    #[device]
    pub r#loop: Array,
    pub log: Vec<H>,
}

fn forward(v: &DefaultedView<'_>) -> Tensor {
    let _ = *v.r#type;
    v.r#loop
}

fn main() {
    assert!(Nothing::FIELDS.is_empty());
    let _ = Nothing {}.graph_const_digest();
    let h = HostOnly {
        data: vec![1.0],
        name: String::new(),
    };
    assert_eq!(h.device_signature(), Signature::default());
    let _ = (h.data, h.name);
    let d: Defaulted = Defaulted {
        r#type: 1,
        r#loop: Array::scalar(1.0f32),
        log: vec![],
    };
    let _ = (d.log, forward);
}
