//! The SPMD spike (issue 33, item 3): programs that JAX 0.10.2 lowered with shardings
//! (`bench/spmd_spike.py`, Shardy's `sdy.mesh`/`sdy.sharding` attributes) compile through the
//! plugin with `Client::compile_partitioned` on 4 CPU devices, and each device's shard of the
//! result is the matching rows or columns of the unpartitioned result computed here on the host:
//! FSDP (a gradient whose weight and batch are split by rows), tensor parallelism (a two-layer
//! MLP split on its hidden units) and a 2-D mesh (both at once). Then nitro's own: a traced
//! MLP gradient emitted with FSDP shardings (`EmitOptions::sharding`) runs partitioned on 4
//! devices and gathers to the one-device program's gradient.
#![allow(missing_docs)]

mod common;

use nitro::emit::{emit, emit_with, EmitOptions};
use nitro::shard::{Mesh, PartitionSpec, ProgramSharding};
use nitro::trace;
use nitro::{Array, DType, LeafType};

fn text(name: &str) -> String {
    std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/spmd")
            .join(format!("{name}.mlir")),
    )
    .unwrap()
}

/// A row-major matrix.
#[derive(Clone, Debug, PartialEq)]
struct M {
    rows: usize,
    cols: usize,
    v: Vec<f32>,
}

impl M {
    fn seeded(rows: usize, cols: usize, seed: u32) -> M {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        let v = (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2000) as f32 / 1000.0 - 1.0
            })
            .collect();
        M { rows, cols, v }
    }

    fn at(&self, r: usize, c: usize) -> f32 {
        self.v[r * self.cols + c]
    }

    fn rows(&self, start: usize, n: usize) -> M {
        M {
            rows: n,
            cols: self.cols,
            v: self.v[start * self.cols..(start + n) * self.cols].to_vec(),
        }
    }

    fn cols(&self, start: usize, n: usize) -> M {
        let v = (0..self.rows)
            .flat_map(|r| (start..start + n).map(move |c| (r, c)))
            .map(|(r, c)| self.at(r, c))
            .collect();
        M {
            rows: self.rows,
            cols: n,
            v,
        }
    }

    fn matmul(&self, o: &M) -> M {
        let mut v = vec![0.0f32; self.rows * o.cols];
        for r in 0..self.rows {
            for k in 0..self.cols {
                for c in 0..o.cols {
                    v[r * o.cols + c] += self.at(r, k) * o.at(k, c);
                }
            }
        }
        M {
            rows: self.rows,
            cols: o.cols,
            v,
        }
    }

    fn t(&self) -> M {
        let v = (0..self.cols)
            .flat_map(|c| (0..self.rows).map(move |r| (r, c)))
            .map(|(r, c)| self.at(r, c))
            .collect();
        M {
            rows: self.cols,
            cols: self.rows,
            v,
        }
    }

    fn map(&self, f: impl Fn(f32) -> f32) -> M {
        M {
            v: self.v.iter().map(|&x| f(x)).collect(),
            ..self.clone()
        }
    }

    fn array(&self) -> Array {
        Array::from_vec(&[self.rows, self.cols], self.v.clone()).unwrap()
    }

    fn ty(&self) -> LeafType {
        LeafType::new(DType::F32, &[self.rows, self.cols])
    }
}

#[track_caller]
fn close(got: &Array, want: &M, what: &str) {
    assert_eq!(got.dims(), &[want.rows, want.cols], "{what}");
    let worst = common::max_abs_diff(got, &want.v);
    assert!(worst <= 1e-5, "{what}: max |Δ| {worst:e}");
}

/// Compiles `name` over 4 partitions and runs it with each device's shards.
fn run(name: &str, shards: &[Vec<M>], outputs: &[LeafType]) -> Option<Vec<Vec<Array>>> {
    let xla = common::xla_devices_or_skip(name, 4)?;
    let inputs: Vec<LeafType> = shards[0].iter().map(M::ty).collect();
    let exe = xla
        .client()
        .compile_partitioned(&text(name), &inputs, outputs, 4)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(exe.replicas(), 4);
    let arrays: Vec<Vec<Array>> = shards
        .iter()
        .map(|d| d.iter().map(M::array).collect())
        .collect();
    let refs: Vec<Vec<&Array>> = arrays.iter().map(|d| d.iter().collect()).collect();
    let lists: Vec<&[&Array]> = refs.iter().map(Vec::as_slice).collect();
    Some(exe.execute_host_replicas(&lists).unwrap())
}

#[test]
fn fsdp_gradient_shards_by_rows() {
    // d/dw Σ tanh(x·w) = xᵀ · (1 − tanh²(x·w)); w [8,16] and x [4,8] split by rows.
    let (w, x) = (M::seeded(8, 16, 1), M::seeded(4, 8, 2));
    let t = x.matmul(&w).map(f32::tanh);
    let grad = x.t().matmul(&t.map(|v| 1.0 - v * v));
    let shards: Vec<Vec<M>> = (0..4)
        .map(|d| vec![w.rows(2 * d, 2), x.rows(d, 1)])
        .collect();
    let out = LeafType::new(DType::F32, &[2, 16]);
    let Some(got) = run("a_fsdp_grad", &shards, &[out]) else {
        return;
    };
    for (d, outs) in got.iter().enumerate() {
        close(&outs[0], &grad.rows(2 * d, 2), &format!("device {d}"));
    }
}

#[test]
fn tensor_parallel_mlp_splits_the_hidden_units() {
    // relu(x·w1)·w2: w1's columns and w2's rows split on "model", x and the result whole.
    let (w1, w2, x) = (M::seeded(8, 16, 3), M::seeded(16, 8, 4), M::seeded(4, 8, 5));
    let want = x.matmul(&w1).map(|v| v.max(0.0)).matmul(&w2);
    let shards: Vec<Vec<M>> = (0..4)
        .map(|d| vec![w1.cols(4 * d, 4), w2.rows(4 * d, 4), x.clone()])
        .collect();
    let Some(got) = run("b_tp", &shards, &[want.ty()]) else {
        return;
    };
    for (d, outs) in got.iter().enumerate() {
        close(&outs[0], &want, &format!("device {d}"));
    }
}

#[test]
fn a_two_dimensional_mesh_splits_batch_and_hidden_units() {
    // Mesh data=2 × model=2, device = 2·data + model: x's rows on "data", the hidden units on
    // "model"; each device ends with its data rows of the result.
    let (w1, w2, x) = (M::seeded(8, 16, 6), M::seeded(16, 8, 7), M::seeded(4, 8, 8));
    let want = x.matmul(&w1).map(|v| v.max(0.0)).matmul(&w2);
    let shards: Vec<Vec<M>> = (0..4)
        .map(|d| {
            let (data, model) = (d / 2, d % 2);
            vec![
                w1.cols(8 * model, 8),
                w2.rows(8 * model, 8),
                x.rows(2 * data, 2),
            ]
        })
        .collect();
    let out = LeafType::new(DType::F32, &[2, 8]);
    let Some(got) = run("c_2d", &shards, &[out]) else {
        return;
    };
    for (d, outs) in got.iter().enumerate() {
        close(&outs[0], &want.rows(2 * (d / 2), 2), &format!("device {d}"));
    }
}

#[test]
fn a_nitro_traced_gradient_sharded_fsdp_gathers_to_the_one_device_gradient() {
    let Some(xla) = common::xla_devices_or_skip("nitro FSDP gradient", 4) else {
        return;
    };
    let ty = |d: &[usize]| LeafType::new(DType::F32, d);
    let types: Vec<(String, LeafType)> = [
        ("w1", ty(&[16, 32])),
        ("b1", ty(&[32])),
        ("w2", ty(&[32, 8])),
        ("x", ty(&[8, 16])),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_owned(), t))
    .collect();
    // The mean square of a two-layer MLP's output, and its gradient by every parameter.
    let graph = trace::trace(&types, |t| {
        let h = (t[3].matmul(t[0]) + t[1]).tanh();
        let y = h.matmul(t[2]);
        let loss = (y * y).sum_all() / 64.0;
        let mut out = vec![loss];
        out.extend(trace::grad(loss, &[t[0], t[1], t[2]]));
        out
    })
    .unwrap();
    let mesh = Mesh::new([("data", 4)]).unwrap();
    // FSDP: each parameter split along its largest dim that 4 divides; the batch by rows.
    let mut inputs: Vec<PartitionSpec> = types[..3]
        .iter()
        .map(|(_, t)| PartitionSpec::fsdp(&mesh, "data", &t.dims))
        .collect();
    assert_eq!(
        inputs[0],
        PartitionSpec::new([None, Some("data")]),
        "w1 on its 32"
    );
    inputs.push(PartitionSpec::new([Some("data"), None]));
    let mut outputs = vec![PartitionSpec::replicated()];
    outputs.extend(inputs[..3].iter().cloned());
    let sharding = ProgramSharding {
        mesh: mesh.clone(),
        inputs: inputs.clone(),
        outputs: outputs.clone(),
    };
    let text = emit_with(
        &graph,
        &EmitOptions {
            sharding: Some(sharding),
            ..EmitOptions::default()
        },
    );
    assert!(text.contains("sdy.mesh @mesh = <[\"data\"=4]>"), "{text}");
    assert!(text.contains("mhlo.num_partitions = 4"), "{text}");

    let values: Vec<Array> = types
        .iter()
        .enumerate()
        .map(|(k, (_, t))| {
            let m = M::seeded(t.dims[0], t.dims.iter().skip(1).product(), 10 + k as u32);
            Array::from_vec(&t.dims, m.v).unwrap()
        })
        .collect();
    let out_types: Vec<LeafType> = graph
        .outputs
        .iter()
        .map(|&o| graph.nodes[o as usize].ty.clone())
        .collect();
    // One device, unpartitioned.
    let client = xla.client();
    let in_types: Vec<LeafType> = types.iter().map(|(_, t)| t.clone()).collect();
    let whole = client
        .compile(&emit(&graph), &in_types, &out_types)
        .unwrap()
        .execute_host(&values.iter().collect::<Vec<_>>())
        .unwrap();
    // Four devices, partitioned: per-device shards in, shards out, gathered.
    let shard_in: Vec<LeafType> = inputs
        .iter()
        .zip(&in_types)
        .map(|(s, t)| s.shard_type(&mesh, t))
        .collect();
    let shard_out: Vec<LeafType> = outputs
        .iter()
        .zip(&out_types)
        .map(|(s, t)| s.shard_type(&mesh, t))
        .collect();
    let exe = client
        .compile_partitioned(&text, &shard_in, &shard_out, 4)
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    let split: Vec<Vec<Array>> = inputs
        .iter()
        .zip(&values)
        .zip(&types)
        .map(|((s, v), (n, _))| s.split(&mesh, v, n).unwrap())
        .collect();
    let per_device: Vec<Vec<&Array>> = (0..4)
        .map(|d| split.iter().map(|shards| &shards[d]).collect())
        .collect();
    let lists: Vec<&[&Array]> = per_device.iter().map(Vec::as_slice).collect();
    let got = exe.execute_host_replicas(&lists).unwrap();
    for (k, spec) in outputs.iter().enumerate() {
        let shards: Vec<Array> = got.iter().map(|d| d[k].clone()).collect();
        let gathered = spec.gather(&mesh, &shards, "output").unwrap();
        let want = &whole[k];
        assert_eq!(gathered.dims(), want.dims(), "output {k}");
        let worst = common::max_abs_diff(&gathered, want.as_slice::<f32>().unwrap());
        assert!(worst <= 1e-5, "output {k}: max |Δ| {worst:e}");
    }
}

#[test]
fn meshes_and_specs_refuse_what_cannot_shard() {
    let err = |r: nitro::Result<()>| r.unwrap_err().to_string();
    assert!(Mesh::new(Vec::<(&str, usize)>::new()).is_err());
    assert!(Mesh::new([("data", 0)]).is_err());
    assert!(Mesh::new([("data", 2), ("data", 2)]).is_err());
    assert!(Mesh::new([("a-b", 2)]).is_err());
    let mesh = Mesh::new([("data", 2), ("model", 2)]).unwrap();
    let w = LeafType::new(DType::F32, &[9, 64]);
    let e = err(PartitionSpec::new([Some("model"), None]).check(&mesh, &w, "leaf `fc.w`"));
    assert!(
        e.contains("leaf `fc.w` f32[9,64]") && e.contains("dim 0 (9)") && e.contains("`model`"),
        "{e}"
    );
    let e = err(PartitionSpec::new([None, Some("pipe")]).check(&mesh, &w, "w"));
    assert!(e.contains("axis `pipe`"), "{e}");
    let even = LeafType::new(DType::F32, &[8, 64]);
    let e = err(PartitionSpec::new([Some("data"), Some("data")]).check(&mesh, &even, "w"));
    assert!(e.contains("two dims"), "{e}");
    let e = err(PartitionSpec::new([None, None, Some("data")]).check(&mesh, &w, "w"));
    assert!(e.contains("names 3 dims"), "{e}");
    // FSDP's rule: the largest dim the axis divides; none, replicated.
    assert_eq!(
        PartitionSpec::fsdp(&mesh, "data", &[10, 64]),
        PartitionSpec::new([None, Some("data")])
    );
    assert_eq!(
        PartitionSpec::fsdp(&mesh, "data", &[3, 5]),
        PartitionSpec::replicated()
    );
}

#[test]
fn split_and_gather_round_trip_on_a_two_dimensional_mesh() {
    let mesh = Mesh::new([("data", 2), ("model", 2)]).unwrap();
    let a = Array::from_vec(&[4, 6], (0..24).map(|i| i as f32).collect()).unwrap();
    for spec in [
        PartitionSpec::new([Some("data"), Some("model")]),
        PartitionSpec::new([Some("model"), None]),
        PartitionSpec::new([None, Some("data")]),
        PartitionSpec::replicated(),
    ] {
        let shards = spec.split(&mesh, &a, "a").unwrap();
        assert_eq!(shards.len(), 4);
        assert_eq!(
            shards[0].leaf_type(),
            spec.shard_type(&mesh, &a.leaf_type()),
            "{spec}"
        );
        assert_eq!(spec.gather(&mesh, &shards, "a").unwrap(), a, "{spec}");
    }
    // Device 3 is data 1, model 1: rows 2..4, columns 3..6.
    let both = PartitionSpec::new([Some("data"), Some("model")]);
    let shards = both.split(&mesh, &a, "a").unwrap();
    assert_eq!(
        shards[3].as_slice::<f32>().unwrap(),
        &[15.0, 16.0, 17.0, 21.0, 22.0, 23.0]
    );
}
