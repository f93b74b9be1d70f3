//! What the training handle keeps between runs, on either backend: host arrays on the
//! interpreter, device buffers on XLA, one per replica when programs are replicated over
//! several devices — and one way to run a program over them, so the handle has a single code
//! path for every backend and device count.

use std::borrow::Cow;

use crate::backend::pjrt::{Arg, Completion, DeviceBuffer};
use crate::backend::Backend;
use crate::cache::Compiled;
use crate::error::{Error, Result};
use crate::shard::{group_spec, Mesh, PartitionSpec};
use crate::tree::{Array, ArrayData, LeafType};

/// One value kept between runs.
pub(crate) enum Value {
    /// On the host (the interpreter's "device").
    Host(Array),
    /// In a device buffer (XLA).
    Device(DeviceBuffer),
    /// One value per replica of a replicated program, replica `r`'s on device `r` (or one
    /// whole copy per device of a partitioned program).
    Replicas(Vec<Value>),
    /// One shard per device of a partitioned program, cut as the spec says over the mesh: a
    /// leaf under FSDP ([`crate::shard::Sharding::fsdp`]), a batch's rows.
    Sharded(Vec<Value>, Box<(PartitionSpec, Mesh)>),
}

impl Value {
    /// Its dtype and dims (one replica's).
    pub(crate) fn leaf_type(&self) -> LeafType {
        match self {
            Value::Host(a) => a.leaf_type(),
            Value::Device(b) => b.leaf_type().clone(),
            Value::Replicas(r) => r
                .first()
                .map_or_else(|| Array::scalar(0.0f32).leaf_type(), |v| v.leaf_type()),
            Value::Sharded(shards, layout) => {
                let (spec, mesh) = &**layout;
                let mut ty = shards
                    .first()
                    .map_or_else(|| Array::scalar(0.0f32).leaf_type(), |v| v.leaf_type());
                for (d, axis) in spec.0.iter().enumerate() {
                    if let (Some(n), Some(axis)) = (ty.dims.get_mut(d), axis) {
                        *n *= mesh.size(axis).unwrap_or(1);
                    }
                }
                ty
            }
        }
    }

    /// The bytes one device holds of it: the whole value, or its shard.
    pub(crate) fn device_bytes(&self) -> u64 {
        match self {
            Value::Replicas(r) | Value::Sharded(r, _) => r.first().map_or(0, Value::device_bytes),
            v => v.leaf_type().size_bytes().unwrap_or(u64::MAX),
        }
    }

    /// A host copy (waits for the computation that produces it on XLA). Of replicated values,
    /// replica 0's: every replica holds the same parameters, state and reduced sums.
    pub(crate) fn to_host(&self) -> Result<Array> {
        match self {
            Value::Host(a) => Ok(a.clone()),
            Value::Device(b) => b.to_host(),
            Value::Replicas(r) => r.first().ok_or_else(no_replica)?.to_host(),
            Value::Sharded(shards, layout) => {
                let (spec, mesh) = &**layout;
                let parts = shards
                    .iter()
                    .map(Value::to_host)
                    .collect::<Result<Vec<_>>>()?;
                spec.gather(mesh, &parts, "a sharded value")
            }
        }
    }

    /// Host copies of every replica's value (one for an unreplicated or sharded value, whole).
    pub(crate) fn replicas_to_host(&self) -> Result<Vec<Array>> {
        match self {
            Value::Replicas(r) => r.iter().map(Value::to_host).collect(),
            v => Ok(vec![v.to_host()?]),
        }
    }

    /// A host copy of a value whose replicas hold consecutive rows of one batch (the
    /// predictions), joined back in replica order.
    pub(crate) fn rows_to_host(&self) -> Result<Array> {
        match self {
            Value::Replicas(r) => {
                let parts = r.iter().map(Value::to_host).collect::<Result<Vec<_>>>()?;
                join_rows(&parts)
            }
            v => v.to_host(),
        }
    }

    /// The first element as `f64` (a loss, a count).
    pub(crate) fn scalar(&self) -> Result<f64> {
        let a = match self {
            Value::Host(a) => std::borrow::Cow::Borrowed(a),
            v => std::borrow::Cow::Owned(v.to_host()?),
        };
        fn first<T: crate::tree::Element>(a: &Array, f: impl Fn(T) -> f64) -> Result<f64> {
            Ok(a.as_slice::<T>()?.first().copied().map_or(0.0, f))
        }
        use crate::DType as D;
        match a.dtype() {
            D::F32 => first(&a, |x: f32| f64::from(x)),
            D::F64 => first(&a, |x: f64| x),
            D::BF16 => first(&a, |x: half::bf16| x.to_f64()),
            D::F16 => first(&a, |x: half::f16| x.to_f64()),
            D::I32 => first(&a, |x: i32| f64::from(x)),
            D::I64 => first(&a, |x: i64| x as f64),
            D::U32 => first(&a, |x: u32| f64::from(x)),
            D::U8 => first(&a, |x: u8| f64::from(x)),
            D::Bool => first(&a, |x: bool| if x { 1.0 } else { 0.0 }),
        }
    }
}

/// One argument of [`exec`].
pub(crate) enum In<'a> {
    /// A kept value, lent: still there afterwards.
    Keep(&'a Value),
    /// A kept value, given: the program may reuse its memory (donation, where the program
    /// marks it), and it is gone afterwards.
    Give(Value),
    /// A host array of batch rows (a batch leaf, a row mask): uploaded first on XLA; with
    /// several replicas, replica `r` gets the `r`-th of as many equal runs of rows.
    Rows(&'a Array),
    /// A host array every device gets whole (a partitioned program's random key).
    Whole(&'a Array),
}

/// `arrays` placed where `backend` keeps values between runs: one copy per replica when its
/// programs are replicated.
pub(crate) fn place(backend: &dyn Backend, arrays: Vec<Array>) -> Result<Vec<Value>> {
    let replicas = backend.devices();
    match backend.device() {
        Some(client) if replicas > 1 => arrays
            .iter()
            .map(|a| {
                (0..replicas)
                    .map(|r| client.upload_to(a, r).map(Value::Device))
                    .collect::<Result<Vec<_>>>()
                    .map(Value::Replicas)
            })
            .collect(),
        Some(client) => arrays
            .iter()
            .map(|a| client.upload(a).map(Value::Device))
            .collect(),
        None if replicas > 1 => Ok(arrays
            .into_iter()
            .map(|a| Value::Replicas((0..replicas).map(|_| Value::Host(a.clone())).collect()))
            .collect()),
        None => Ok(arrays.into_iter().map(Value::Host).collect()),
    }
}

/// A batch array (a row mask) placed to be kept: with several replicas, replica `r` keeps the
/// `r`-th run of its rows (as [`In::Rows`] would pass it).
pub(crate) fn place_rows(backend: &dyn Backend, rows: Array) -> Result<Value> {
    let replicas = backend.devices();
    if replicas == 1 {
        return place(backend, vec![rows])?.pop().ok_or_else(no_replica);
    }
    // Partitioned: split along the batch axis (devices that differ only along another axis
    // get the same rows).
    if let (Some(p), Some(client)) = (backend.partitioning(), backend.device()) {
        return upload_split(client, p.rows(), p.mesh(), &rows, "a row mask");
    }
    let parts = split_rows(&rows, replicas)?;
    let values = match backend.device() {
        Some(client) => parts
            .iter()
            .enumerate()
            .map(|(r, p)| client.upload_to(p, r).map(Value::Device))
            .collect::<Result<Vec<_>>>()?,
        None => parts.into_iter().map(Value::Host).collect(),
    };
    Ok(Value::Replicas(values))
}

/// The trainable leaves' groups (or an optimizer slot's, or gradient sums), placed where
/// `backend` keeps them: on a partitioned backend, each split as its spec in `specs` says (one
/// spec per group, repeating for every slot) — [`place`] otherwise, or for a group kept whole.
pub(crate) fn place_groups(
    backend: &dyn Backend,
    arrays: Vec<Array>,
    specs: &[PartitionSpec],
) -> Result<Vec<Value>> {
    if backend.partitioning().is_none() {
        return place(backend, arrays);
    }
    arrays
        .into_iter()
        .enumerate()
        .map(|(i, a)| place_group(backend, Cow::Owned(a), group_spec(specs, i)))
        .collect()
}

/// One group placed as [`place_groups`] places it: split by `spec` over the backend's mesh,
/// or whole (on every device).
pub(crate) fn place_group(
    backend: &dyn Backend,
    a: Cow<'_, Array>,
    spec: &PartitionSpec,
) -> Result<Value> {
    match (backend.partitioning(), backend.device()) {
        (Some(p), Some(client)) if !spec.is_whole() => {
            upload_split(client, spec.clone(), p.mesh(), &a, "a trainable leaf")
        }
        _ => place(backend, vec![a.into_owned()])?
            .pop()
            .ok_or_else(no_replica),
    }
}

/// Zeroed groups of `types` (an optimizer slot's, the gradient sums' starting point), placed as
/// [`place_groups`] would place zero arrays — but on a mesh each device's shard is made zero on
/// its own, in the shard's shape, so no whole array is ever written on the host. Zeroed memory
/// costs nothing until read ([`Array::try_zeros`]).
pub(crate) fn place_zero_groups(
    backend: &dyn Backend,
    types: &[LeafType],
    specs: &[PartitionSpec],
) -> Result<Vec<Value>> {
    let (Some(p), Some(client)) = (backend.partitioning(), backend.device()) else {
        let zeros = types
            .iter()
            .map(|t| Array::try_zeros(t.dtype, &t.dims))
            .collect::<Result<Vec<_>>>()?;
        return place(backend, zeros);
    };
    types
        .iter()
        .enumerate()
        .map(|(i, ty)| {
            let spec = group_spec(specs, i);
            if spec.is_whole() {
                let zeros = Array::try_zeros(ty.dtype, &ty.dims)?;
                return place_group(backend, Cow::Owned(zeros), spec);
            }
            spec.check(
                p.mesh(),
                ty,
                "zeroed state (an optimizer slot, gradient sums)",
            )?;
            let shard = spec.shard_type(p.mesh(), ty);
            let values = (0..p.mesh().devices())
                .map(|d| {
                    let zeros = Array::try_zeros(shard.dtype, &shard.dims)?;
                    client.upload_to(&zeros, d).map(Value::Device)
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Value::Sharded(
                values,
                Box::new((spec.clone(), p.mesh().clone())),
            ))
        })
        .collect()
}

/// A group of type `ty` placed as [`place_group`] places it, from its pieces: `read` gives the
/// windows (`(start, len)` per dim) asked for, one array each. On a mesh, split by `spec`,
/// each device's window is read and uploaded to it, so no whole array is made on the host
/// unless a device holds it whole.
pub(crate) fn place_group_from(
    backend: &dyn Backend,
    ty: &LeafType,
    spec: &PartitionSpec,
    read: impl FnOnce(&[Vec<(usize, usize)>]) -> Result<Vec<Array>>,
) -> Result<Value> {
    let whole = || ty.dims.iter().map(|&d| (0, d)).collect::<Vec<_>>();
    match (backend.partitioning(), backend.device()) {
        (Some(p), Some(client)) if !spec.is_whole() => {
            let mesh = p.mesh();
            spec.check(mesh, ty, "a restored leaf")?;
            // A window several devices hold (a dim not split along every axis) is read once
            // and uploaded to each of them.
            let mut windows: Vec<Vec<(usize, usize)>> = Vec::new();
            let of_device: Vec<usize> = (0..mesh.devices())
                .map(|d| {
                    let w = spec.window(mesh, &ty.dims, d);
                    windows.iter().position(|u| *u == w).unwrap_or_else(|| {
                        windows.push(w);
                        windows.len() - 1
                    })
                })
                .collect();
            let shards = read(&windows)?;
            let values = of_device
                .iter()
                .enumerate()
                .map(|(d, &w)| {
                    let shard = shards.get(w).ok_or_else(no_replica)?;
                    client.upload_to(shard, d).map(Value::Device)
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Value::Sharded(
                values,
                Box::new((spec.clone(), mesh.clone())),
            ))
        }
        _ => {
            let a = read(&[whole()])?.pop().ok_or_else(no_replica)?;
            place_group(backend, Cow::Owned(a), spec)
        }
    }
}

/// `a` cut by `spec` over `mesh` (`what` names it in errors), device `d`'s shard uploaded to
/// device `d`.
fn upload_split(
    client: &crate::backend::pjrt::Client,
    spec: PartitionSpec,
    mesh: &Mesh,
    a: &Array,
    what: &str,
) -> Result<Value> {
    let values = spec
        .split(mesh, a, what)?
        .iter()
        .enumerate()
        .map(|(d, s)| client.upload_to(s, d).map(Value::Device))
        .collect::<Result<Vec<_>>>()?;
    Ok(Value::Sharded(values, Box::new((spec, mesh.clone()))))
}

/// Host copies of `values`.
pub(crate) fn to_host(values: &[Value]) -> Result<Vec<Array>> {
    values.iter().map(Value::to_host).collect()
}

/// Runs `compiled` on `args`. On XLA the run is enqueued, not waited for: its outputs are
/// buffers in the making, and the completions (one per replica) say when it is done. On the
/// interpreter it runs at once and there is no completion.
pub(crate) fn exec(
    compiled: &Compiled,
    args: Vec<In<'_>>,
) -> Result<(Vec<Value>, Vec<Completion>)> {
    exec_donating(compiled, args).map(|(outputs, done, _)| (outputs, done))
}

/// [`exec`], and whether every argument given ([`In::Give`]) was donated on every replica —
/// its memory now holds the output aliased to it (on XLA; never on the interpreter).
pub(crate) fn exec_donating(
    compiled: &Compiled,
    args: Vec<In<'_>>,
) -> Result<(Vec<Value>, Vec<Completion>, bool)> {
    let given = args.iter().filter(|a| matches!(a, In::Give(_))).count();
    let replicas = compiled.executable.replicas();
    if replicas > 1 || compiled.sharding.is_some() {
        return exec_replicas(compiled, args, replicas, given);
    }
    match compiled.executable.as_pjrt() {
        Some(exe) => {
            let client = exe.client();
            let uploads: Vec<DeviceBuffer> = args
                .iter()
                .filter_map(|a| match a {
                    In::Rows(a) | In::Whole(a) => Some(client.upload(a)),
                    _ => None,
                })
                .collect::<Result<_>>()?;
            let mut uploaded = uploads.iter();
            let mut pjrt_args = Vec::with_capacity(args.len());
            for a in args {
                pjrt_args.push(match a {
                    In::Keep(Value::Device(b)) => Arg::Borrow(b),
                    In::Give(Value::Device(b)) => Arg::Donate(b),
                    In::Rows(_) | In::Whole(_) => Arg::Borrow(uploaded.next().ok_or_else(mixed)?),
                    _ => return Err(mixed()),
                });
            }
            let executed = exe.enqueue(pjrt_args)?;
            let donated = executed.donated.len() == given;
            let outputs = executed.outputs.into_iter().map(Value::Device).collect();
            Ok((outputs, vec![executed.done], donated))
        }
        None => {
            let refs: Vec<&Array> = args
                .iter()
                .map(|a| match a {
                    In::Keep(Value::Host(a)) | In::Give(Value::Host(a)) => Ok(a),
                    In::Rows(a) | In::Whole(a) => Ok(*a),
                    _ => Err(mixed()),
                })
                .collect::<Result<_>>()?;
            let outputs = compiled.executable.run(&refs)?;
            Ok((
                outputs.into_iter().map(Value::Host).collect(),
                Vec::new(),
                false,
            ))
        }
    }
}

/// [`exec`] for a program replicated over `replicas` devices: every kept value holds one value
/// per replica, and every batch array is split into equal runs of rows, one per replica.
fn exec_replicas(
    compiled: &Compiled,
    args: Vec<In<'_>>,
    replicas: usize,
    given: usize,
) -> Result<(Vec<Value>, Vec<Completion>, bool)> {
    // Each batch array's rows, split once, in argument order.
    // A partitioned program's host arguments are cut by their specs.
    let sharding = compiled.sharding.as_ref();
    let splits: Vec<Vec<Array>> = args
        .iter()
        .enumerate()
        .filter_map(|(i, a)| match (a, sharding) {
            (In::Rows(a) | In::Whole(a), Some(s)) => {
                Some(s.inputs.get(i).cloned().unwrap_or_default().split(
                    &s.mesh,
                    a,
                    "a batch array",
                ))
            }
            (In::Rows(a), None) => Some(split_rows(a, replicas)),
            (In::Whole(a), None) => Some(Ok(vec![(*a).clone(); replicas])),
            _ => None,
        })
        .collect::<Result<_>>()?;
    // And its results put together by theirs: split ones kept as their shards.
    let gathered = |k: usize, values: Vec<Value>| match sharding {
        Some(s) => match s.outputs.get(k) {
            Some(spec) if !spec.is_whole() => {
                Value::Sharded(values, Box::new((spec.clone(), s.mesh.clone())))
            }
            _ => Value::Replicas(values),
        },
        None => Value::Replicas(values),
    };
    let outputs = compiled.outputs.len();
    match compiled.executable.as_pjrt() {
        Some(exe) => {
            let client = exe.client();
            let uploads: Vec<Vec<DeviceBuffer>> = splits
                .iter()
                .map(|parts| {
                    parts
                        .iter()
                        .enumerate()
                        .map(|(r, p)| client.upload_to(p, r))
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<_>>()?;
            let mut lists: Vec<Vec<Arg<'_>>> = (0..replicas)
                .map(|_| Vec::with_capacity(args.len()))
                .collect();
            let mut uploaded = uploads.iter();
            for a in args {
                match a {
                    // A partitioned program on a mesh of one device keeps plain values.
                    In::Keep(Value::Device(b)) if replicas == 1 => lists[0].push(Arg::Borrow(b)),
                    In::Give(Value::Device(b)) if replicas == 1 => lists[0].push(Arg::Donate(b)),
                    In::Keep(Value::Replicas(values) | Value::Sharded(values, _))
                        if values.len() == replicas =>
                    {
                        for (list, v) in lists.iter_mut().zip(values) {
                            let Value::Device(b) = v else {
                                return Err(mixed());
                            };
                            list.push(Arg::Borrow(b));
                        }
                    }
                    In::Give(Value::Replicas(values) | Value::Sharded(values, _))
                        if values.len() == replicas =>
                    {
                        for (list, v) in lists.iter_mut().zip(values) {
                            let Value::Device(b) = v else {
                                return Err(mixed());
                            };
                            list.push(Arg::Donate(b));
                        }
                    }
                    In::Rows(_) | In::Whole(_) => {
                        let parts = uploaded.next().ok_or_else(mixed)?;
                        for (list, b) in lists.iter_mut().zip(parts) {
                            list.push(Arg::Borrow(b));
                        }
                    }
                    _ => return Err(mixed()),
                }
            }
            let runs = exe.enqueue_replicas(lists)?;
            let mut per_output: Vec<Vec<Value>> =
                (0..outputs).map(|_| Vec::with_capacity(replicas)).collect();
            let mut done = Vec::with_capacity(replicas);
            let donated = runs.iter().all(|run| run.donated.len() == given);
            for run in runs {
                for (slot, b) in per_output.iter_mut().zip(run.outputs) {
                    slot.push(Value::Device(b));
                }
                done.push(run.done);
            }
            // The CPU plugin runs every device's part of an execution on one shared thread pool,
            // and a collective blocks its thread until every replica arrives: with executions
            // of several programs in flight, the threads can all be taken by replicas waiting
            // for one that is queued behind them — a deadlock XLA ends by aborting the process
            // after 40 s (seen with 4 devices on 2 cores). So on CPU a replicated execution is
            // waited for before the next is enqueued. Other platforms stay asynchronous (not
            // checked on a GPU here).
            if client.platform_name().eq_ignore_ascii_case("cpu") {
                for d in std::mem::take(&mut done) {
                    d.wait()?;
                }
            }
            Ok((
                per_output
                    .into_iter()
                    .enumerate()
                    .map(|(k, v)| gathered(k, v))
                    .collect(),
                done,
                donated,
            ))
        }
        None => {
            let mut lists: Vec<Vec<&Array>> = (0..replicas)
                .map(|_| Vec::with_capacity(args.len()))
                .collect();
            let mut split = splits.iter();
            for a in &args {
                match a {
                    In::Keep(Value::Replicas(values)) | In::Give(Value::Replicas(values))
                        if values.len() == replicas =>
                    {
                        for (list, v) in lists.iter_mut().zip(values) {
                            let Value::Host(a) = v else {
                                return Err(mixed());
                            };
                            list.push(a);
                        }
                    }
                    In::Rows(_) | In::Whole(_) => {
                        let parts = split.next().ok_or_else(mixed)?;
                        for (list, p) in lists.iter_mut().zip(parts) {
                            list.push(p);
                        }
                    }
                    _ => return Err(mixed()),
                }
            }
            let refs: Vec<&[&Array]> = lists.iter().map(Vec::as_slice).collect();
            let runs = compiled.executable.run_replicas(&refs)?;
            let mut per_output: Vec<Vec<Value>> =
                (0..outputs).map(|_| Vec::with_capacity(replicas)).collect();
            for run in runs {
                for (slot, a) in per_output.iter_mut().zip(run) {
                    slot.push(Value::Host(a));
                }
            }
            Ok((
                per_output
                    .into_iter()
                    .enumerate()
                    .map(|(k, v)| gathered(k, v))
                    .collect(),
                Vec::new(),
                false,
            ))
        }
    }
}

/// How the per-batch programs receive the trainable leaves, which the handle keeps packed
/// ([`Nitro::leaf_inputs`](super::Nitro::leaf_inputs)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeafInputs {
    /// Each leaf is a view of its packed buffer's memory: no copy (XLA, where the plugin makes
    /// views).
    Views,
    /// Each leaf is a copy made once per update: on the interpreter (a host slice), or on XLA
    /// when views are turned off ([`Config::leaf_views`](super::Config::leaf_views)) or the
    /// plugin refuses them (a round trip through the host: slower, measured in `bench/`).
    Copies,
}

/// `a` cut along its first dim into `parts` equal runs of rows, in order.
pub(crate) fn split_rows(a: &Array, parts: usize) -> Result<Vec<Array>> {
    let rows = a.dims().first().copied().unwrap_or(1);
    if parts == 0 || a.dims().is_empty() || rows % parts != 0 {
        return Err(Error::Devices {
            what: "a batch split across devices".into(),
            requested: parts,
            reason: format!(
                "an array of {} cannot be cut into {parts} equal runs of rows; make the batch \
                 size a multiple of the device count",
                a.leaf_type()
            ),
        });
    }
    let per = rows / parts;
    (0..parts)
        .map(|p| {
            let span: Vec<usize> = (p * per..(p + 1) * per).collect();
            crate::data::gather_rows(a, &span)
        })
        .collect()
}

/// Arrays of one dtype and the same trailing dims joined along their first dim.
pub(crate) fn join_rows(parts: &[Array]) -> Result<Array> {
    let Some(first) = parts.first() else {
        return Err(no_replica());
    };
    if first.dims().is_empty() {
        return Ok(first.clone());
    }
    let mut dims = first.dims().to_vec();
    dims[0] = parts.iter().map(|p| p.dims()[0]).sum();
    let data: Vec<&ArrayData> = parts.iter().map(Array::data).collect();
    let joined = ArrayData::concat(first.data(), &data).ok_or_else(mixed)?;
    Array::from_data(&dims, joined)
}

pub(super) fn mixed() -> Error {
    Error::Misconfigured {
        message: "a training handle's values are split between host and device, or between \
                  device counts"
            .into(),
    }
}

fn no_replica() -> Error {
    Error::Misconfigured {
        message: "a replicated value has no replica".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_split_and_join_back() {
        let a = Array::from_vec(&[4, 2], (0..8).map(|i| i as f32).collect()).unwrap();
        let parts = split_rows(&a, 2).unwrap();
        assert_eq!(parts[0].dims(), &[2, 2]);
        assert_eq!(parts[1].as_slice::<f32>().unwrap(), &[4.0, 5.0, 6.0, 7.0]);
        assert_eq!(join_rows(&parts).unwrap(), a);
        let err = split_rows(&a, 3).unwrap_err();
        assert!(matches!(err, Error::Devices { requested: 3, .. }), "{err}");
    }
}
