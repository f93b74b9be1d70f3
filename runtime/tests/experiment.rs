//! `#[experiment]` end to end: roles, digests, signatures, views, manifests.
#![allow(missing_docs)]

use nitro::prelude::*;
use nitro::{FieldInfo, LeafPath, Role};

#[derive(ContentHash, Clone, Debug, PartialEq)]
pub struct Arch {
    pub hidden: usize,
    pub activation: Activation,
}

#[derive(ContentHash, Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    Tanh,
    Relu,
}

#[derive(Tree, Clone, Debug, PartialEq)]
pub struct Dense {
    pub w: Array,
    pub b: Array,
}

/// A digits classifier.
#[experiment]
#[derive(Clone)]
pub struct Digits {
    #[graph_const]
    pub arch: Arch,
    #[graph_const]
    pub classes: u32,
    #[device(trainable)]
    pub layers: Vec<Dense>,
    #[device]
    pub lr: Array,
    #[host]
    pub seed: u64,
    pub notes: String,
}

fn dense(i: usize, o: usize) -> Dense {
    Dense {
        w: Array::zeros(DType::F32, &[i, o]),
        b: Array::zeros(DType::F32, &[o]),
    }
}

fn digits() -> Digits {
    Digits {
        arch: Arch {
            hidden: 128,
            activation: Activation::Tanh,
        },
        classes: 10,
        layers: vec![dense(64, 128), dense(128, 10)],
        lr: Array::scalar(0.1f32),
        seed: 0,
        notes: String::new(),
    }
}

#[test]
fn fields_and_roles_are_listed_in_order() {
    let fields: Vec<(&str, &str, Role)> = Digits::FIELDS
        .iter()
        .map(|f| (f.name, f.ty, f.role))
        .collect();
    assert_eq!(
        fields,
        vec![
            ("arch", "Arch", Role::GraphConst),
            ("classes", "u32", Role::GraphConst),
            ("layers", "Vec<Dense>", Role::Device { trainable: true }),
            ("lr", "Array", Role::Device { trainable: false }),
            ("seed", "u64", Role::Host),
            ("notes", "String", Role::Host),
        ]
    );
    assert!(
        Digits::TYPE_PATH.ends_with("::Digits"),
        "{}",
        Digits::TYPE_PATH
    );
    assert!(!Digits::TYPE_PATH.contains('<'));
}

#[test]
fn graph_const_change_moves_the_digest_and_names_the_field() {
    let a = digits();
    let mut b = a.clone();
    b.arch.hidden = 64;
    assert_ne!(a.graph_const_digest(), b.graph_const_digest());
    let moved: Vec<&str> = a
        .graph_const_field_digests()
        .iter()
        .zip(b.graph_const_field_digests())
        .filter(|(x, y)| x.1 != y.1)
        .map(|(x, _)| x.0)
        .collect();
    assert_eq!(moved, vec!["arch"]);
}

#[test]
fn device_and_host_values_do_not_move_the_digest() {
    let a = digits();
    let mut b = a.clone();
    b.lr = Array::scalar(0.5f32);
    b.layers[0].w.as_slice_mut::<f32>().unwrap()[0] = 3.0;
    b.seed = 7;
    b.notes.push_str("changed");
    assert_eq!(a.graph_const_digest(), b.graph_const_digest());
    assert_eq!(a.device_signature(), b.device_signature());
}

#[test]
fn device_signature_names_every_leaf_and_moves_with_shape_and_dtype() {
    let a = digits();
    assert_eq!(
        a.device_signature().to_string(),
        "layers[0].w: f32[64,128], layers[0].b: f32[128], layers[1].w: f32[128,10], \
         layers[1].b: f32[10], lr: f32[]"
    );
    let mut wider = a.clone();
    wider.layers[1] = dense(128, 12);
    let (path, from, to) = a
        .device_signature()
        .first_difference(&wider.device_signature())
        .expect("shapes differ");
    assert_eq!(
        (path.as_str(), from.as_str(), to.as_str()),
        ("layers[1].w", "f32[128,10]", "f32[128,12]")
    );

    let mut f64_lr = a.clone();
    f64_lr.lr = Array::scalar(0.1f64);
    assert_eq!(
        a.device_signature()
            .first_difference(&f64_lr.device_signature()),
        Some(("lr".into(), "f32[]".into(), "f64[]".into()))
    );
}

#[test]
fn the_type_path_and_field_names_seed_the_digest() {
    #[experiment]
    pub struct Other {
        #[graph_const]
        pub arch: Arch,
        #[graph_const]
        pub classes: u32,
    }
    #[experiment]
    pub struct Renamed {
        #[graph_const]
        pub arch: Arch,
        #[graph_const]
        pub n_classes: u32,
    }
    let d = digits();
    let o = Other {
        arch: d.arch.clone(),
        classes: d.classes,
    };
    let r = Renamed {
        arch: d.arch.clone(),
        n_classes: d.classes,
    };
    assert_eq!(d.graph_const_field_digests(), o.graph_const_field_digests());
    assert_ne!(d.graph_const_digest(), o.graph_const_digest());
    assert_ne!(o.graph_const_digest(), r.graph_const_digest());
}

#[test]
fn view_holds_graph_consts_by_reference_and_devices_as_tensors() {
    let d = digits();
    let mut seen = Vec::new();
    nitro::trace::trace_with(|| {
        let view = d.view(&mut |field: &FieldInfo, path: &LeafPath, leaf: &Array| {
            seen.push((field.name, path.to_string(), leaf.dims().to_vec()));
            nitro::trace::input(path.as_str(), leaf.leaf_type())
        });
        assert!(std::ptr::eq(view.arch, &d.arch));
        assert_eq!(*view.classes, 10);
        assert_eq!(view.layers.len(), 2);
        assert_eq!(view.layers[1].b.dims(), vec![10]);
        assert_eq!(view.lr.dims(), Vec::<usize>::new());
        vec![view.layers[1].b]
    })
    .unwrap();
    assert_eq!(seen[2], ("layers", "layers[1].w".to_owned(), vec![128, 10]));
    assert_eq!(seen.len(), 5);
}

#[test]
fn visit_device_mut_writes_back_in_walk_order() {
    let mut d = digits();
    let mut trainable = 0;
    d.visit_device_mut(&mut |field, _, leaf| {
        if field.role == (Role::Device { trainable: true }) {
            trainable += 1;
            let n = leaf.len();
            *leaf = Array::from_vec(leaf.dims(), vec![1.0f32; n]).unwrap();
        }
    });
    assert_eq!(trainable, 4);
    assert_eq!(d.layers[1].b.as_slice::<f32>().unwrap(), &[1.0; 10]);
    assert_eq!(d.lr.as_slice::<f32>().unwrap(), &[0.1]);
}

#[test]
fn schema_digest_moves_with_names_types_and_roles() {
    mod a {
        #[nitro::experiment]
        pub struct S {
            #[graph_const]
            pub width: usize,
        }
    }
    mod b {
        #[nitro::experiment]
        pub struct S {
            #[graph_const]
            pub height: usize,
        }
    }
    mod c {
        #[nitro::experiment]
        pub struct S {
            #[graph_const]
            pub width: u64,
        }
    }
    mod d {
        #[nitro::experiment]
        pub struct S {
            pub width: usize,
        }
        pub fn read(s: &S) -> usize {
            s.width
        }
    }
    mod same {
        #[nitro::experiment]
        pub struct S {
            #[graph_const]
            pub width: usize,
        }
    }
    use nitro::Experiment;
    let digests = [
        a::S::SCHEMA_DIGEST,
        b::S::SCHEMA_DIGEST,
        c::S::SCHEMA_DIGEST,
        d::S::SCHEMA_DIGEST,
    ];
    for i in 0..digests.len() {
        for j in i + 1..digests.len() {
            assert_ne!(digests[i], digests[j], "schemas {i} and {j} collide");
        }
    }
    assert_eq!(a::S::SCHEMA_DIGEST, same::S::SCHEMA_DIGEST);
    assert_eq!(d::read(&d::S { width: 3 }), 3);
}

#[test]
fn key_manifest_lists_every_field() {
    let m = Digits::key_manifest();
    assert_eq!(m.fields.len(), 6);
    let json: serde_json::Value = serde_json::from_str(&m.to_json()).unwrap();
    assert_eq!(json["fields"][2]["name"], "layers");
    assert_eq!(json["fields"][2]["role"]["device"]["trainable"], true);
    assert_eq!(json["fields"][0]["role"], "graph_const");
    assert_eq!(json["fields"][5]["role"], "host");
    assert_eq!(
        json["fields"][5]["enters_key_as"],
        "nothing — not visible to traced code"
    );
    assert_eq!(json["schema_digest"], Digits::SCHEMA_DIGEST.to_string());
}

#[test]
fn assert_graphconst_hashable_passes_derived_and_catches_unstable_impls() {
    nitro::assert_graphconst_hashable(&digits()).unwrap();

    /// A hand-written impl that hashes an address: never stable across clones.
    #[derive(Clone)]
    pub struct ByAddress(Box<u8>);
    impl ContentHash for ByAddress {
        fn content_hash(&self, h: &mut nitro::ContentHasher) {
            h.write_u64(&*self.0 as *const u8 as u64);
        }
    }
    #[experiment]
    #[derive(Clone)]
    pub struct Bad {
        #[graph_const]
        pub ok: u8,
        #[graph_const]
        pub by_address: ByAddress,
    }
    let err = nitro::assert_graphconst_hashable(&Bad {
        ok: 1,
        by_address: ByAddress(Box::new(1)),
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("`by_address`"), "{msg}");
    assert!(matches!(
        err,
        nitro::Error::UnstableGraphConstHash {
            field: "by_address",
            ..
        }
    ));
}

#[test]
fn generic_experiments_key_on_their_fields() {
    #[experiment]
    pub struct Generic<C: ContentHash, T: Tree, H> {
        #[graph_const]
        pub config: C,
        #[device]
        pub params: T,
        pub host_only: H,
    }
    let g = Generic {
        config: 3u8,
        params: vec![Array::zeros(DType::I32, &[2])],
        host_only: "x",
    };
    let h = Generic {
        config: 3u8,
        params: vec![Array::zeros(DType::I32, &[2])],
        host_only: 5.0,
    };
    assert_eq!(g.graph_const_digest(), h.graph_const_digest());
    assert_eq!((g.host_only, h.host_only), ("x", 5.0));
    assert_eq!(g.device_signature().to_string(), "params[0]: i32[2]");
    nitro::trace::trace_with(|| {
        let v = g.view(&mut |_, path, leaf| nitro::trace::input(path.as_str(), leaf.leaf_type()));
        assert_eq!((*v.config, v.params[0].dims()), (3, vec![2]));
        vec![]
    })
    .unwrap();
}

#[test]
fn raw_identifiers_are_named_without_their_prefix() {
    #[derive(Tree)]
    pub struct Block {
        pub r#in: Array,
    }
    #[experiment]
    pub struct Raw {
        #[graph_const]
        pub r#type: u8,
        #[device]
        pub r#loop: Block,
    }
    let r = Raw {
        r#type: 1,
        r#loop: Block {
            r#in: Array::scalar(1.0f32),
        },
    };
    assert_eq!(Raw::FIELDS[0].name, "type");
    assert_eq!(r.graph_const_field_digests()[0].0, "type");
    assert_eq!(r.device_signature().to_string(), "loop.in: f32[]");
    assert!(Raw::key_manifest().to_json().contains(r#""name": "loop""#));
}
