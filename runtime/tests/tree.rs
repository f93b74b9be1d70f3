//! Arrays and trees: signatures, paths, mirrors and write-back.
#![allow(missing_docs)]

use nitro::tree::EntryKind;
use nitro::{Array, DType, LeafPath, Node, Tree};

#[derive(Tree, Clone, Debug, PartialEq)]
struct Dense {
    w: Array,
    b: Array,
}

#[derive(Tree)]
struct Pair(Array, Option<Array>);

#[derive(Tree)]
struct Stack<T: Tree> {
    layers: Vec<T>,
    head: (Array, Box<Array>),
    fixed: [Array; 2],
}

fn f32s(dims: &[usize]) -> Array {
    Array::zeros(DType::F32, dims)
}

#[test]
fn paths_follow_fields_indices_and_tuples() {
    let s = Stack {
        layers: vec![Dense {
            w: f32s(&[2, 3]),
            b: f32s(&[3]),
        }],
        head: (
            Array::zeros(DType::I32, &[4]),
            Box::new(Array::scalar(true)),
        ),
        fixed: [f32s(&[1]), Array::zeros(DType::U8, &[5, 5])],
    };
    assert_eq!(
        s.signature_at("params").to_string(),
        "params.layers[0].w: f32[2,3], params.layers[0].b: f32[3], params.head.0: i32[4], \
         params.head.1: bool[], params.fixed[0]: f32[1], params.fixed[1]: u8[5,5]"
    );
    assert_eq!(s.leaf_count(), 6);
    let p = Pair(f32s(&[1]), None);
    assert_eq!(p.signature_at("").to_string(), "0: f32[1], 1: None");
}

#[test]
fn empty_structure_is_part_of_the_signature() {
    let none: Vec<Vec<Array>> = vec![];
    let one_empty: Vec<Vec<Array>> = vec![vec![]];
    assert_ne!(none.signature_at("x"), one_empty.signature_at("x"));
    assert_eq!(none.signature_at("x").entries[0].kind, EntryKind::Seq(0));
    let absent: Option<Array> = None;
    let present = Some(f32s(&[]));
    assert_ne!(absent.signature_at("o"), present.signature_at("o"));
}

#[test]
fn signature_ignores_values_but_sees_shape_and_dtype() {
    let a = Dense {
        w: f32s(&[2, 2]),
        b: f32s(&[2]),
    };
    let mut values = a.clone();
    values.w.as_slice_mut::<f32>().unwrap()[3] = 9.0;
    assert_eq!(a.signature_at("d"), values.signature_at("d"));
    assert_eq!(
        a.signature_at("d").digest(),
        values.signature_at("d").digest()
    );

    let shape = Dense {
        w: f32s(&[2, 3]),
        b: f32s(&[2]),
    };
    assert_ne!(
        a.signature_at("d").digest(),
        shape.signature_at("d").digest()
    );
    let dtype = Dense {
        w: Array::zeros(DType::F64, &[2, 2]),
        b: f32s(&[2]),
    };
    assert_eq!(
        a.signature_at("d")
            .first_difference(&dtype.signature_at("d")),
        Some((
            "d.w".to_owned(),
            "f32[2,2]".to_owned(),
            "f64[2,2]".to_owned()
        ))
    );
    // A transposed shape with the same byte size is still a different signature.
    let t = Dense {
        w: f32s(&[1, 4]),
        b: f32s(&[2]),
    };
    assert_ne!(a.signature_at("d"), t.signature_at("d"));
}

#[test]
fn mirror_keeps_structure_and_walk_order() {
    let layers = vec![
        Dense {
            w: f32s(&[2, 3]),
            b: f32s(&[3]),
        },
        Dense {
            w: f32s(&[3, 1]),
            b: f32s(&[1]),
        },
    ];
    let mut order = Vec::new();
    let m: Vec<DenseMirror<String>> =
        layers.mirror(&mut LeafPath::root("layers"), &mut |path, a| {
            order.push(path.to_string());
            format!("{}{:?}", path, a.dims())
        });
    assert_eq!(m[1].w, "layers[1].w[3, 1]");
    let mut visited = Vec::new();
    layers.visit(&mut LeafPath::root("layers"), &mut |path, node| {
        if let Node::Leaf(_) = node {
            visited.push(path.to_string());
        }
    });
    assert_eq!(order, visited);
    // The mirror of tensors is Copy/Clone/Debug when its leaves are.
    let copied = DenseMirror { w: 1u32, b: 2u32 };
    let again = copied;
    assert_eq!(
        format!("{:?}", copied.clone()),
        "DenseMirror { w: 1, b: 2 }"
    );
    assert_eq!(again.b, 2);
}

#[test]
fn visit_mut_writes_every_leaf() {
    let mut s = Stack {
        layers: vec![
            Dense {
                w: f32s(&[2]),
                b: f32s(&[1])
            };
            3
        ],
        head: (f32s(&[1]), Box::new(f32s(&[1]))),
        fixed: [f32s(&[1]), f32s(&[1])],
    };
    let mut n = 0.0f32;
    s.visit_mut(&mut LeafPath::root("s"), &mut |_, leaf| {
        n += 1.0;
        let len = leaf.len();
        *leaf = Array::from_vec(&[len], vec![n; len]).unwrap();
    });
    assert_eq!(n, 10.0);
    assert_eq!(s.layers[2].b.as_slice::<f32>().unwrap(), &[6.0]);
    assert_eq!(s.fixed[1].as_slice::<f32>().unwrap(), &[10.0]);
}

#[test]
fn arrays_check_their_inputs() {
    let err = Array::from_vec(&[2, 3], vec![1i64; 5]).unwrap_err();
    assert!(
        err.to_string()
            .contains("need 6 elements but the data has 5"),
        "{err}"
    );
    let a = Array::from_vec(&[2], vec![1u8, 2]).unwrap();
    let err = a.as_slice::<f32>().unwrap_err();
    assert!(matches!(
        err,
        nitro::Error::DTypeMismatch {
            expected: DType::F32,
            got: DType::U8
        }
    ));
    assert_eq!(
        Array::full(&[2, 2], 7i32).as_slice::<i32>().unwrap(),
        &[7; 4]
    );
    assert_eq!(Array::scalar(2.5f64).dims(), &[] as &[usize]);
    assert_eq!(Array::zeros(DType::Bool, &[3]).size_bytes(), 3);
    assert_eq!(
        format!("{:?}", Array::from_vec(&[2], vec![1.5f32, 2.0]).unwrap()),
        "Array(f32[2] [1.5, 2.0])"
    );
    for d in DType::ALL {
        assert_eq!(Array::zeros(d, &[2, 3]).dtype(), d);
        assert_eq!(Array::zeros(d, &[2, 3]).size_bytes(), 6 * d.size_bytes());
    }
}

#[test]
fn leaf_values_enter_array_content_hash_but_not_signature() {
    let a = Array::from_vec(&[2], vec![1.0f32, 2.0]).unwrap();
    let b = Array::from_vec(&[2], vec![1.0f32, 3.0]).unwrap();
    assert_ne!(nitro::Digest::of(&a), nitro::Digest::of(&b));
    assert_eq!(a.signature_at("a"), b.signature_at("a"));
}
