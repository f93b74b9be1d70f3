//! Pretrained weights: a PyTorch-style file written by Python's `safetensors`
//! (`tests/fixtures/weights/torch_style.safetensors`, from `bench/weights_fixtures.py`) loads
//! into an experiment's leaves with renames and permutes; every mismatch is refused by name
//! before anything changes; and an export reads back.
#![allow(missing_docs)]

mod common;

use nitro::prelude::*;
use nitro::weights::{self, Import};
use nitro::Error;

#[derive(Tree, Clone, Debug, PartialEq)]
pub struct Dense {
    pub w: Array,
    pub b: Array,
}

#[experiment]
#[derive(Clone, Debug)]
pub struct Net {
    #[device(trainable)]
    pub fc: Dense,
    #[device(trainable)]
    pub conv: Dense,
}

fn fresh() -> Net {
    Net {
        fc: Dense {
            w: Array::zeros(DType::F32, &[4, 3]),
            b: Array::zeros(DType::F32, &[3]),
        },
        conv: Dense {
            w: Array::zeros(DType::F32, &[3, 3, 1, 2]),
            b: Array::zeros(DType::F32, &[2]),
        },
    }
}

fn fixture() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/weights/torch_style.safetensors")
}

/// torch's names (`.weight`, `.bias`) to ours, its layouts permuted into ours.
fn torch_import() -> Import {
    Import::new()
        .rename_with(|n| n.replace(".weight", ".w").replace(".bias", ".b"))
        .permute("fc.w", &[1, 0])
        .permute("conv.w", &[2, 3, 1, 0])
}

fn why(e: Error) -> String {
    match e {
        Error::DataFile { why, .. } => why,
        other => panic!("expected DataFile, got {other:?}"),
    }
}

#[test]
fn a_torch_file_loads_with_renames_and_permutes() {
    let mut net = fresh();
    let loaded = weights::load_into(&mut net, fixture(), &torch_import().allow_extra()).unwrap();
    assert_eq!(loaded.leaves, ["fc.w", "fc.b", "conv.w", "conv.b"]);
    assert_eq!(loaded.ignored.len(), 1, "{:?}", loaded.ignored);
    // fc.weight[o][i] = (4o + i) / 10 lands at w[i][o].
    let w = net.fc.w.as_slice::<f32>().unwrap();
    assert_eq!(
        w[2 * 3 + 1],
        (4 + 2) as f32 / 10.0,
        "w[2][1] is weight[1][2]"
    );
    assert_eq!(net.fc.b.as_slice::<f32>().unwrap(), &[0.5, -0.5, 1.0]);
    // conv.weight[o][0][h][x] = 9o + 3h + x − 9 lands at w[h][x][0][o].
    let k = net.conv.w.as_slice::<f32>().unwrap();
    assert_eq!(
        k[(3 + 2) * 2 + 1],
        (9 + 3 + 2 - 9) as f32,
        "w[1][2][0][1] is weight[1][0][1][2]"
    );
}

#[test]
fn every_mismatch_is_refused_by_name_and_nothing_changes() {
    let mut net = fresh();
    let before = net.clone();
    // An extra tensor, without allow_extra.
    let e = why(weights::load_into(&mut net, fixture(), &torch_import()).unwrap_err());
    assert!(
        e.contains("`bn.num_batches_tracked`") && e.contains("i64[]"),
        "{e}"
    );
    // A layout left unpermuted: both shapes named.
    let no_permute = Import::new()
        .rename_with(|n| n.replace(".weight", ".w").replace(".bias", ".b"))
        .allow_extra();
    let e = why(weights::load_into(&mut net, fixture(), &no_permute).unwrap_err());
    assert!(
        e.contains("tensor `fc.weight` is f32[3,4] but leaf `fc.w` is f32[4,3]"),
        "{e}"
    );
    // Names left as they are: every leaf is missing, every tensor extra.
    let e = why(weights::load_into(&mut net, fixture(), &Import::new()).unwrap_err());
    assert!(
        e.contains("leaf `fc.w` (f32[4,3]) has no tensor in the file"),
        "{e}"
    );
    assert!(
        e.contains("tensor `fc.weight` (f32[3,4]) is not a leaf"),
        "{e}"
    );
    // Two names for one leaf.
    let twice = torch_import().rename("conv.bias", "fc.b").allow_extra();
    let e = why(weights::load_into(&mut net, fixture(), &twice).unwrap_err());
    assert!(e.contains("both map to `fc.b`"), "{e}");
    assert_eq!(net.fc, before.fc, "a refused load changes nothing");
    assert_eq!(net.conv, before.conv);
}

#[test]
fn an_export_reads_back_by_leaf_path() {
    let mut net = fresh();
    weights::load_into(&mut net, fixture(), &torch_import().allow_extra()).unwrap();
    let dir = common::TempDir::new("weights");
    std::fs::create_dir_all(dir.path()).unwrap();
    let out = dir.path().join("exported.safetensors");
    weights::export(&net, &out).unwrap();
    let mut back = fresh();
    let loaded = weights::load_into(&mut back, &out, &Import::new()).unwrap();
    assert_eq!(loaded.leaves.len(), 4);
    assert_eq!((back.fc, back.conv), (net.fc, net.conv));
}
