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

// ---- sizes ---------------------------------------------------------------------------------------

/// `[1 << 62, 4]` claims 2^64 elements: it used to wrap to 0 and hold nothing. Every Array
/// constructor refuses it with a typed error (checked arithmetic), never an empty array.
#[test]
fn array_dims_whose_count_overflows_are_refused() {
    use nitro::{Error, LeafType};
    let too_large = |r: Result<Array, Error>| match r {
        Err(Error::ShapeTooLarge { ty }) => ty,
        other => panic!("expected ShapeTooLarge, got {other:?}"),
    };
    let ty = too_large(Array::from_vec(&[1 << 62, 4], Vec::<f32>::new()));
    assert_eq!(ty, LeafType::new(DType::F32, &[1 << 62, 4]));
    let e = Array::from_vec(&[1 << 62, 4], Vec::<f32>::new()).unwrap_err();
    assert!(
        e.to_string()
            .contains("f32[4611686018427387904,4] is too large"),
        "{e}"
    );
    assert!(e.to_string().contains("use smaller dims"), "{e}");
    too_large(Array::from_vec(&[usize::MAX, usize::MAX], Vec::<u8>::new()));
    too_large(Array::from_data(
        &[1 << 32, 1 << 32],
        nitro::ArrayData::Bool(vec![]),
    ));
    // Within usize, but over 2^63 - 1 bytes.
    too_large(Array::from_vec(&[1 << 61], Vec::<f32>::new()));
    // A zero dim counts as 1 for the limit, so the other dims stay bounded.
    too_large(Array::from_vec(&[0, 1 << 62], Vec::<f32>::new()));
    too_large(Array::try_zeros(DType::F32, &[1 << 62, 4]));
    too_large(Array::try_full(&[1 << 62, 4], 1.5f64));

    // The infallible constructors panic with the same message rather than wrap.
    let panicked = std::panic::catch_unwind(|| Array::zeros(DType::F32, &[1 << 62, 4]));
    let message = panicked.expect_err("zeros must not return an array");
    let text = message
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(
        text.contains("Array::zeros: f32[4611686018427387904,4] is too large"),
        "{text}"
    );

    // Small and empty shapes are fine.
    assert_eq!(Array::try_zeros(DType::I64, &[2, 0, 3]).unwrap().len(), 0);
    assert_eq!(
        Array::from_vec(&[0, 5], Vec::<f32>::new()).unwrap().dims(),
        &[0, 5]
    );
    assert_eq!(
        Array::try_full(&[2, 2], 7u8)
            .unwrap()
            .as_slice::<u8>()
            .unwrap(),
        &[7; 4]
    );
}

/// A shape within the limit that no machine can hold is an allocation error, not an abort.
#[test]
fn array_allocations_that_fail_are_errors() {
    // 2^61 bytes: more than any x86-64 or aarch64 address space, whatever the overcommit policy.
    match Array::try_zeros(DType::F32, &[1 << 29, 1 << 30]) {
        Err(nitro::Error::OutOfMemory { bytes, what }) => {
            assert_eq!(bytes, 1 << 61);
            assert!(what.contains("f32[536870912,1073741824]"), "{what}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
}

#[test]
fn leaf_type_sizes_are_checked() {
    use nitro::{LeafType, MAX_TENSOR_BYTES};
    assert_eq!(MAX_TENSOR_BYTES, i64::MAX as u64);
    let t = LeafType::new(DType::F64, &[3, 4]);
    assert_eq!(t.element_count(), Some(12));
    assert_eq!(t.size_bytes(), Some(96));
    assert!(t.within_limit());
    let scalar = LeafType::new(DType::U8, &[]);
    assert_eq!(
        (scalar.element_count(), scalar.size_bytes()),
        (Some(1), Some(1))
    );
    // Exactly at the limit: 2^63 - 1 one-byte elements.
    let edge = LeafType::new(DType::U8, &[i64::MAX as usize]);
    assert_eq!(edge.size_bytes(), Some(MAX_TENSOR_BYTES));
    let over = LeafType::new(DType::U8, &[1 << 63]);
    assert!(!over.within_limit());
    assert_eq!((over.element_count(), over.size_bytes()), (None, None));
    let empty_but_wide = LeafType::new(DType::F32, &[0, 1 << 62]);
    assert_eq!(empty_but_wide.element_count(), None);
}
