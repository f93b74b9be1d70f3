//! What the training handle keeps between runs, on either backend: host arrays on the
//! interpreter, device buffers on XLA — and one way to run a program over them, so the handle
//! has a single code path for both.

use crate::backend::pjrt::{Arg, Completion, DeviceBuffer};
use crate::backend::Backend;
use crate::cache::Compiled;
use crate::error::{Error, Result};
use crate::tree::{Array, LeafType};

/// One value kept between runs.
pub(crate) enum Value {
    /// On the host (the interpreter's "device").
    Host(Array),
    /// In a device buffer (XLA).
    Device(DeviceBuffer),
}

impl Value {
    /// Its dtype and dims.
    pub(crate) fn leaf_type(&self) -> LeafType {
        match self {
            Value::Host(a) => a.leaf_type(),
            Value::Device(b) => b.leaf_type().clone(),
        }
    }

    /// A host copy (waits for the computation that produces it on XLA).
    pub(crate) fn to_host(&self) -> Result<Array> {
        match self {
            Value::Host(a) => Ok(a.clone()),
            Value::Device(b) => b.to_host(),
        }
    }

    /// The first element as `f64` (a loss, a count).
    pub(crate) fn scalar(&self) -> Result<f64> {
        let a = match self {
            Value::Host(a) => std::borrow::Cow::Borrowed(a),
            Value::Device(b) => std::borrow::Cow::Owned(b.to_host()?),
        };
        Ok(match a.dtype() {
            crate::DType::F32 => f64::from(a.as_slice::<f32>()?.first().copied().unwrap_or(0.0)),
            crate::DType::F64 => a.as_slice::<f64>()?.first().copied().unwrap_or(0.0),
            _ => 0.0,
        })
    }
}

/// One argument of [`exec`].
pub(crate) enum In<'a> {
    /// A kept value, lent: still there afterwards.
    Keep(&'a Value),
    /// A kept value, given: the program may reuse its memory (donation, where the program
    /// marks it), and it is gone afterwards.
    Give(Value),
    /// A host array (a batch leaf): uploaded first on XLA.
    Array(&'a Array),
}

/// `arrays` placed where `backend` keeps values between runs.
pub(crate) fn place(backend: &dyn Backend, arrays: Vec<Array>) -> Result<Vec<Value>> {
    match backend.device() {
        Some(client) => arrays
            .iter()
            .map(|a| client.upload(a).map(Value::Device))
            .collect(),
        None => Ok(arrays.into_iter().map(Value::Host).collect()),
    }
}

/// Host copies of `values`.
pub(crate) fn to_host(values: &[Value]) -> Result<Vec<Array>> {
    values.iter().map(Value::to_host).collect()
}

/// Runs `compiled` on `args`. On XLA the run is enqueued, not waited for: its outputs are
/// buffers in the making, and the completion says when it is done. On the interpreter it runs
/// at once and there is no completion.
pub(crate) fn exec(
    compiled: &Compiled,
    args: Vec<In<'_>>,
) -> Result<(Vec<Value>, Option<Completion>)> {
    match compiled.executable.as_pjrt() {
        Some(exe) => {
            let client = exe.client();
            let uploads: Vec<DeviceBuffer> = args
                .iter()
                .filter_map(|a| match a {
                    In::Array(a) => Some(client.upload(a)),
                    _ => None,
                })
                .collect::<Result<_>>()?;
            let mut uploaded = uploads.iter();
            let mut pjrt_args = Vec::with_capacity(args.len());
            for a in args {
                pjrt_args.push(match a {
                    In::Keep(Value::Device(b)) => Arg::Borrow(b),
                    In::Give(Value::Device(b)) => Arg::Donate(b),
                    In::Array(_) => Arg::Borrow(uploaded.next().ok_or_else(mixed)?),
                    In::Keep(Value::Host(_)) | In::Give(Value::Host(_)) => return Err(mixed()),
                });
            }
            let executed = exe.enqueue(pjrt_args)?;
            let outputs = executed.outputs.into_iter().map(Value::Device).collect();
            Ok((outputs, Some(executed.done)))
        }
        None => {
            let refs: Vec<&Array> = args
                .iter()
                .map(|a| match a {
                    In::Keep(Value::Host(a)) | In::Give(Value::Host(a)) => Ok(a),
                    In::Array(a) => Ok(*a),
                    In::Keep(Value::Device(_)) | In::Give(Value::Device(_)) => Err(mixed()),
                })
                .collect::<Result<_>>()?;
            let outputs = compiled.executable.run(&refs)?;
            Ok((outputs.into_iter().map(Value::Host).collect(), None))
        }
    }
}

fn mixed() -> Error {
    Error::Misconfigured {
        message: "a training handle's values are split between host and device".into(),
    }
}
