//! The XLA backend through the PJRT C API, against whatever plugin this machine has.
//!
//! Tests that need a plugin print a `skip:` line and pass when none is installed, unless
//! `NITRO_REQUIRE_XLA=1` (or `NITRO_BACKEND=xla`), where they fail loudly. Install one with
//! `pip install --no-deps lammps-jax-pjrt-cpu==0.11.2` (or set `NITRO_PJRT_PLUGIN`).
#![allow(missing_docs)]

use std::path::{Path, PathBuf};
use std::time::Instant;

use nitro::backend::pjrt::{self, Arg, Client, Discovery, Platform, Plugin};
use nitro::{Array, DType, Error, LeafType};

/// The process-wide client, or `None` (after a skip line) when no plugin is installed and
/// `NITRO_REQUIRE_XLA` is not `1`.
fn client_or_skip(test: &str) -> Option<&'static Client> {
    match pjrt::client() {
        Ok(c) => Some(c),
        Err(e) => {
            let required = std::env::var("NITRO_REQUIRE_XLA").is_ok_and(|v| v.trim() == "1")
                || std::env::var("NITRO_BACKEND").is_ok_and(|v| v.trim() == "xla");
            let absent = match &e {
                Error::PjrtPluginNotFound { .. } => true,
                Error::BackendSetting { value, .. } => value == "interp",
                _ => false,
            };
            if required || !absent {
                panic!("{test}: the XLA backend is required but unavailable: {e}");
            }
            println!("skip: {test}: {e}");
            None
        }
    }
}

fn f32_type(dims: &[usize]) -> LeafType {
    LeafType {
        dtype: DType::F32,
        dims: dims.to_vec(),
    }
}

fn f32s(dims: &[usize], data: &[f32]) -> Array {
    Array::from_vec(dims, data.to_vec()).unwrap()
}

const ADD: &str = r#"// stablehlo.add, element-wise on two f32 2x3 tensors.
module @add {
  func.func public @main(%a: tensor<2x3xf32>, %b: tensor<2x3xf32>) -> tensor<2x3xf32> {
    %0 = stablehlo.add %a, %b : tensor<2x3xf32>
    return %0 : tensor<2x3xf32>
  }
}
"#;

const DONATE: &str = r#"module @donate {
  func.func public @main(%w: tensor<3xf32> {tf.aliasing_output = 0 : i32}, %g: tensor<3xf32>, %lr: tensor<f32>) -> tensor<3xf32> {
    %lrb = stablehlo.broadcast_in_dim %lr, dims = [] : (tensor<f32>) -> tensor<3xf32>
    %step = stablehlo.multiply %lrb, %g : tensor<3xf32>
    %0 = stablehlo.subtract %w, %step : tensor<3xf32>
    return %0 : tensor<3xf32>
  }
}
"#;

fn compile_add(client: &Client) -> pjrt::Executable {
    let t = f32_type(&[2, 3]);
    client
        .compile(ADD, &[t.clone(), t.clone()], &[t])
        .expect("the add program compiles")
}

fn add_inputs() -> (Array, Array) {
    (
        f32s(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        f32s(&[2, 3], &[0.5, -1.0, 10.0, -4.0, 0.25, 100.0]),
    )
}

const ADD_EXPECTED: [f32; 6] = [1.5, 1.0, 13.0, 0.0, 5.25, 106.0];

fn rss_bytes() -> u64 {
    let text = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nitro-pjrt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn touch(root: &Path, rel: &str) -> PathBuf {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, b"not really a plugin").unwrap();
    p
}

#[test]
fn describe_names_the_backend() {
    let d = Discovery::from_env().unwrap();
    println!("candidates: {:?}", d.candidates());
    println!("{}", pjrt::describe());
    if let Some(c) = client_or_skip("describe_names_the_backend") {
        let text = pjrt::describe();
        assert!(
            text.contains(&c.plugin().path().display().to_string()),
            "{text}"
        );
        assert!(text.contains(c.platform_name()), "{text}");
        let (major, minor) = c.plugin().api_version();
        assert!(text.contains(&format!("{major}.{minor}")), "{text}");
        assert!(c.device_count() >= 1);
        let id = c.identity().unwrap();
        println!("identity: {id:?}\nidentity digest: {}", id.digest());
        assert_eq!(id.digest(), c.identity().unwrap().digest());
        assert!(id.cpu_features.starts_with(std::env::consts::ARCH));
    }
}

#[test]
fn discovery_order_and_platform_choice() {
    let root = temp_dir("discovery");
    let (a, b) = (root.join("a"), root.join("b"));
    let old = touch(&a, "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so");
    let cuda = touch(&a, "jax_plugins/xla_cuda12/xla_cuda_plugin.so");
    let new = touch(&b, "lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so");
    let mut d = Discovery {
        explicit: None,
        platform: None,
        site_dirs: vec![a.clone(), b.clone()],
    };
    let found: Vec<PathBuf> = d.candidates().into_iter().map(|(p, _)| p).collect();
    assert_eq!(found, vec![new.clone(), old.clone(), cuda.clone()]);
    assert_eq!(d.find().unwrap(), Some(new.clone()));

    d.platform = Some(Platform::Cuda);
    assert_eq!(d.find().unwrap(), Some(cuda.clone()));
    d.platform = Some(Platform::Cpu);
    assert_eq!(d.find().unwrap(), Some(new.clone()));

    d.site_dirs = vec![root.join("empty")];
    assert_eq!(d.find().unwrap(), None);
    let msg = d.not_found().to_string();
    assert!(
        msg.contains("pip install --no-deps lammps-jax-pjrt-cpu==0.11.2"),
        "{msg}"
    );

    d.explicit = Some(root.join("missing.so"));
    let err = d.find().unwrap_err();
    assert!(matches!(err, Error::PjrtPlugin { .. }), "{err}");
    d.explicit = Some(old.clone());
    assert_eq!(d.find().unwrap(), Some(old));
    assert_eq!(Platform::parse("CUDA"), Some(Platform::Cuda));
    assert_eq!(Platform::parse("tpu"), None);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn nonexistent_plugin_path_is_an_error() {
    let err = Plugin::load("/nonexistent/nitro/plugin.so").unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::PjrtPlugin { .. }), "{msg}");
    assert!(msg.contains("no such file"), "{msg}");
    assert!(msg.contains("pip install --no-deps"), "{msg}");
}

#[test]
fn a_file_that_is_not_a_plugin_is_an_error() {
    let root = temp_dir("notaplugin");
    let fake = root.join("x.so");
    std::fs::write(&fake, "this is a text file, not a shared library\n").unwrap();
    let err = Plugin::load(&fake).unwrap_err();
    let msg = err.to_string();
    println!("text file: {msg}");
    assert!(matches!(err, Error::PjrtPlugin { .. }), "{msg}");
    assert!(msg.contains("not a loadable shared library"), "{msg}");

    // A real shared library that is not a PJRT plugin.
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib64/libm.so.6",
        "/usr/lib64/libm.so.6",
        "/lib/aarch64-linux-gnu/libm.so.6",
    ]
    .into_iter()
    .map(Path::new)
    .find(|p| p.is_file());
    if let Some(libm) = libm {
        let err = Plugin::load(libm).unwrap_err();
        let msg = err.to_string();
        println!("libm: {msg}");
        assert!(msg.contains("does not export GetPjrtApi"), "{msg}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn add_program_runs_from_host_and_device() {
    let Some(client) = client_or_skip("add_program_runs_from_host_and_device") else {
        return;
    };
    let started = Instant::now();
    let exe = compile_add(client);
    println!(
        "compile add: {:.2} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    let (a, b) = add_inputs();
    let out = exe.execute_host(&[&a, &b]).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].dims(), &[2, 3]);
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &ADD_EXPECTED);

    // Buffers stay on the device between executes: feed an output back in.
    let (da, db) = (client.upload(&a).unwrap(), client.upload(&b).unwrap());
    let sum = exe.execute(&[&da, &db]).unwrap().pop().unwrap();
    let twice = exe.execute(&[&sum, &db]).unwrap().pop().unwrap();
    let want: Vec<f32> = ADD_EXPECTED
        .iter()
        .zip(b.as_slice::<f32>().unwrap())
        .map(|(x, y)| x + y)
        .collect();
    assert_eq!(
        twice.to_host().unwrap().as_slice::<f32>().unwrap(),
        want.as_slice()
    );
    assert_eq!(da.to_host().unwrap(), a, "inputs are untouched");
}

#[test]
fn wrong_inputs_are_refused_before_xla_sees_them() {
    let Some(client) = client_or_skip("wrong_inputs_are_refused_before_xla_sees_them") else {
        return;
    };
    let exe = compile_add(client);
    let (a, b) = add_inputs();
    let (da, db) = (client.upload(&a).unwrap(), client.upload(&b).unwrap());

    let err = exe.execute(&[&da]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InputCount {
                expected: 2,
                got: 1
            }
        ),
        "{err}"
    );
    let err = exe.execute(&[&da, &db, &db]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InputCount {
                expected: 2,
                got: 3
            }
        ),
        "{err}"
    );

    // Same byte size, other dims: XLA would run it and reinterpret the bytes.
    let transposed = client.upload(&f32s(&[3, 2], &[0.0; 6])).unwrap();
    let err = exe.execute(&[&da, &transposed]).unwrap_err();
    assert!(
        matches!(&err, Error::InputType { index: 1, got, .. } if got.dims == [3, 2]),
        "{err}"
    );
    // Same byte size, other dtype.
    let ints = client
        .upload(&Array::from_vec(&[2, 3], vec![1i32; 6]).unwrap())
        .unwrap();
    let err = exe.execute(&[&ints, &db]).unwrap_err();
    assert!(
        matches!(&err, Error::InputType { index: 0, got, .. } if got.dtype == DType::I32),
        "{err}"
    );
    println!("{err}");

    let err = exe.execute_host(&[&a]).unwrap_err();
    assert!(matches!(err, Error::InputCount { .. }), "{err}");
    let err = exe
        .execute_host(&[&a, &Array::zeros(DType::F64, &[2, 3])])
        .unwrap_err();
    assert!(matches!(err, Error::InputType { index: 1, .. }), "{err}");
    // The executable still works after refusals.
    assert_eq!(
        exe.execute_host(&[&a, &b]).unwrap()[0]
            .as_slice::<f32>()
            .unwrap(),
        &ADD_EXPECTED
    );
}

#[test]
fn declared_outputs_must_match_the_program() {
    let Some(client) = client_or_skip("declared_outputs_must_match_the_program") else {
        return;
    };
    let t = f32_type(&[2, 3]);
    let err = client
        .compile(ADD, &[t.clone(), t.clone()], &[t.clone(), t.clone()])
        .unwrap_err();
    assert!(matches!(err, Error::ProgramSignature { .. }), "{err}");
    let err = client
        .compile(ADD, &[t.clone(), t.clone()], &[f32_type(&[3, 2])])
        .unwrap_err();
    assert!(matches!(err, Error::ProgramSignature { .. }), "{err}");
    println!("{err}");
    let wrong_dtype = LeafType {
        dtype: DType::I32,
        dims: vec![2, 3],
    };
    let err = client
        .compile(ADD, &[t.clone(), t], &[wrong_dtype])
        .unwrap_err();
    assert!(matches!(err, Error::ProgramSignature { .. }), "{err}");
}

#[test]
fn every_dtype_round_trips_through_the_device() {
    let Some(client) = client_or_skip("every_dtype_round_trips_through_the_device") else {
        return;
    };
    let arrays = [
        Array::from_vec(
            &[2, 2],
            vec![1.5f32, -0.0, f32::INFINITY, f32::MIN_POSITIVE],
        )
        .unwrap(),
        Array::from_vec(&[3], vec![1e300f64, -2.5, f64::EPSILON]).unwrap(),
        Array::from_vec(&[2], vec![i32::MIN, i32::MAX]).unwrap(),
        Array::from_vec(&[2], vec![i64::MIN, 9_007_199_254_740_993]).unwrap(),
        Array::from_vec(&[4], vec![0u8, 1, 254, 255]).unwrap(),
        Array::from_vec(&[3], vec![true, false, true]).unwrap(),
        Array::scalar(7.25f32),
        Array::zeros(DType::F32, &[0, 3]),
    ];
    for a in &arrays {
        let d = client.upload(a).unwrap();
        assert_eq!(d.leaf_type(), &a.leaf_type());
        assert_eq!(&d.to_host().unwrap(), a, "{a:?}");
    }
}

#[test]
fn rejected_stablehlo_reports_xla_first_line() {
    let Some(client) = client_or_skip("rejected_stablehlo_reports_xla_first_line") else {
        return;
    };
    // No implicit broadcasting: adding 2x3 and 3 is invalid.
    let bad =
        "func.func public @main(%a: tensor<2x3xf32>, %b: tensor<3xf32>) -> tensor<2x3xf32> {\n  \
               %0 = stablehlo.add %a, %b : (tensor<2x3xf32>, tensor<3xf32>) -> tensor<2x3xf32>\n  \
               return %0 : tensor<2x3xf32>\n}\n";
    let err = client
        .compile(
            bad,
            &[f32_type(&[2, 3]), f32_type(&[3])],
            &[f32_type(&[2, 3])],
        )
        .unwrap_err();
    let msg = err.to_string();
    println!("{msg}");
    let Error::XlaCompile { first_line, .. } = &err else {
        panic!("expected XlaCompile, got {err}");
    };
    assert!(first_line.starts_with("-:2:"), "{first_line}");
    assert!(first_line.contains("error:"), "{first_line}");
    assert!(msg.contains(first_line.as_str()), "{msg}");

    let err = client.compile("this is not MLIR", &[], &[]).unwrap_err();
    assert!(matches!(err, Error::XlaCompile { .. }), "{err}");
}

#[test]
fn serialize_deserialize_execute_gives_identical_output() {
    let Some(client) = client_or_skip("serialize_deserialize_execute_gives_identical_output")
    else {
        return;
    };
    let exe = compile_add(client);
    let (a, b) = add_inputs();
    let before = exe.execute_host(&[&a, &b]).unwrap();
    let started = Instant::now();
    let bytes = exe.serialize().unwrap();
    let ser_ms = started.elapsed().as_secs_f64() * 1e3;
    assert_eq!(
        &pjrt::serialized_identity(&bytes).unwrap(),
        client.identity().unwrap()
    );
    let started = Instant::now();
    let loaded = client.deserialize(&bytes).unwrap();
    let de_ms = started.elapsed().as_secs_f64() * 1e3;
    println!(
        "serialize: {} bytes in {ser_ms:.2} ms (identity digest included); deserialize: {de_ms:.2} ms",
        bytes.len()
    );
    assert_eq!(loaded.inputs(), exe.inputs());
    assert_eq!(loaded.outputs(), exe.outputs());
    let after = loaded.execute_host(&[&a, &b]).unwrap();
    assert_eq!(before, after);
    // Wrong inputs are still refused on a loaded executable.
    assert!(matches!(
        loaded.execute_host(&[&a]),
        Err(Error::InputCount { .. })
    ));

    let fp = exe.fingerprint().unwrap();
    let fp_loaded = loaded.fingerprint().unwrap();
    println!("fingerprint: {fp:?}; after deserialize: {fp_loaded:?}");
    assert_eq!(
        fp,
        compile_add(client).fingerprint().unwrap(),
        "stable across compiles"
    );
}

/// Rebuilds serialized bytes with the header's JSON edited by `edit`.
fn edit_header(bytes: &[u8], edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[24..24 + len]).unwrap();
    edit(&mut header);
    let json = serde_json::to_vec(&header).unwrap();
    let mut out = bytes[..16].to_vec();
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[24 + len..]);
    out
}

#[test]
fn another_backend_identity_is_refused() {
    let Some(client) = client_or_skip("another_backend_identity_is_refused") else {
        return;
    };
    let exe = compile_add(client);
    let bytes = exe.serialize().unwrap();

    let other_cpu = edit_header(&bytes, |h| {
        h["identity"]["cpu_features"] = "x86_64: sse2".into();
    });
    let err = client.deserialize(&other_cpu).unwrap_err();
    assert!(
        matches!(
            err,
            Error::BackendMismatch {
                component: "CPU features",
                ..
            }
        ),
        "{err}"
    );
    let other_plugin = edit_header(&bytes, |h| {
        h["identity"]["plugin_digest"] = nitro::Digest::of("another plugin").to_string().into();
    });
    let err = client.deserialize(&other_plugin).unwrap_err();
    println!("{err}");
    assert!(
        matches!(
            err,
            Error::BackendMismatch {
                component: "plugin file digest",
                ..
            }
        ),
        "{err}"
    );

    // Corrupt or foreign bytes are refused without reaching the plugin.
    let mut corrupt = bytes.clone();
    *corrupt.last_mut().unwrap() ^= 0xff;
    let err = client.deserialize(&corrupt).unwrap_err();
    assert!(
        matches!(err, Error::InvalidSerializedExecutable { .. }),
        "{err}"
    );
    for junk in [&b""[..], b"garbage", &bytes[..bytes.len() / 2]] {
        let err = client.deserialize(junk).unwrap_err();
        assert!(
            matches!(err, Error::InvalidSerializedExecutable { .. }),
            "{err}"
        );
    }

    // A second installed plugin file: its client refuses this one's executables.
    let mine = client.plugin().path().to_path_buf();
    let everywhere = Discovery {
        explicit: None,
        platform: None,
        site_dirs: pjrt::plugin::site_packages().to_vec(),
    };
    let other = everywhere
        .candidates()
        .into_iter()
        .map(|(p, _)| p)
        .find(|p| p.canonicalize().ok().as_deref() != Some(mine.as_path()));
    let Some(other) = other else {
        println!("skip: cross-plugin refusal: only one plugin installed");
        return;
    };
    let started = Instant::now();
    let plugin = Plugin::load(&other).unwrap();
    let load_ms = started.elapsed().as_secs_f64() * 1e3;
    let started = Instant::now();
    let second = Client::new(plugin).unwrap();
    let client_ms = started.elapsed().as_secs_f64() * 1e3;
    println!(
        "second plugin {} (API {:?}): load+init {load_ms:.1} ms, client {client_ms:.1} ms",
        other.display(),
        plugin.api_version()
    );
    let err = second.deserialize(&bytes).unwrap_err();
    println!("{err}");
    assert!(matches!(err, Error::BackendMismatch { .. }), "{err}");
    // Buffers of one client are refused by the other's executables.
    let theirs = compile_add(&second);
    let (a, b) = add_inputs();
    let (da, db) = (client.upload(&a).unwrap(), client.upload(&b).unwrap());
    let err = theirs.execute(&[&da, &db]).unwrap_err();
    assert!(matches!(err, Error::ForeignBuffer { index: 0 }), "{err}");
    // And the second plugin works on its own.
    assert_eq!(
        theirs.execute_host(&[&a, &b]).unwrap()[0]
            .as_slice::<f32>()
            .unwrap(),
        &ADD_EXPECTED
    );
    let own = second.deserialize(&theirs.serialize().unwrap()).unwrap();
    assert_eq!(
        own.execute_host(&[&a, &b]).unwrap()[0]
            .as_slice::<f32>()
            .unwrap(),
        &ADD_EXPECTED
    );
}

#[test]
fn donation_consumes_the_input_and_borrowing_keeps_it() {
    let Some(client) = client_or_skip("donation_consumes_the_input_and_borrowing_keeps_it") else {
        return;
    };
    let exe = client
        .compile(
            DONATE,
            &[f32_type(&[3]), f32_type(&[3]), f32_type(&[])],
            &[f32_type(&[3])],
        )
        .unwrap();
    let w = f32s(&[3], &[1.0, 2.0, 3.0]);
    let g = f32s(&[3], &[0.5, -1.0, 10.0]);
    let lr = Array::scalar(0.1f32);
    let expected = [0.95f32, 2.1, 2.0];
    let close = |got: &[f32]| got.iter().zip(&expected).all(|(g, e)| (g - e).abs() < 1e-6);

    let (dw, dg, dlr) = (
        client.upload(&w).unwrap(),
        client.upload(&g).unwrap(),
        client.upload(&lr).unwrap(),
    );
    // Borrowed: never donated, even though the program marks input 0.
    let out = exe.execute(&[&dw, &dg, &dlr]).unwrap();
    assert!(!dw.is_deleted().unwrap());
    assert_eq!(dw.to_host().unwrap(), w);
    assert!(close(out[0].to_host().unwrap().as_slice::<f32>().unwrap()));

    // By value: consumed, and XLA reuses its memory for the output.
    let run = exe
        .execute_donating(vec![Arg::Donate(dw), Arg::Borrow(&dg), (&dlr).into()])
        .unwrap();
    assert_eq!(run.donated, vec![0], "input 0 was donated");
    let out = run.outputs[0].to_host().unwrap();
    assert!(close(out.as_slice::<f32>().unwrap()), "{out:?}");
    assert!(!dg.is_deleted().unwrap());

    // A training loop: the output is donated back in each step.
    let mut state = run.outputs.into_iter().next().unwrap();
    for _ in 0..5 {
        let mut r = exe
            .execute_donating(vec![state.into(), (&dg).into(), (&dlr).into()])
            .unwrap();
        assert_eq!(r.donated, vec![0]);
        state = r.outputs.pop().unwrap();
    }
    let got = state.to_host().unwrap();
    let want: Vec<f32> = [1.0f32, 2.0, 3.0]
        .iter()
        .zip([0.5f32, -1.0, 10.0])
        .map(|(w, g)| (0..6).fold(*w, |w, _| w - 0.1 * g))
        .collect();
    for (g, w) in got.as_slice::<f32>().unwrap().iter().zip(&want) {
        assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
    }

    // A program without aliasing simply frees a by-value argument.
    let add = compile_add(client);
    let (a, b) = add_inputs();
    let r = add
        .execute_donating(vec![
            client.upload(&a).unwrap().into(),
            client.upload(&b).unwrap().into(),
        ])
        .unwrap();
    assert!(r.donated.is_empty());
    assert_eq!(
        r.outputs[0].to_host().unwrap().as_slice::<f32>().unwrap(),
        &ADD_EXPECTED
    );
}

#[test]
fn executes_concurrently_from_several_threads() {
    let Some(client) = client_or_skip("executes_concurrently_from_several_threads") else {
        return;
    };
    let exe = compile_add(client);
    let (a, b) = add_inputs();
    let (da, db) = (client.upload(&a).unwrap(), client.upload(&b).unwrap());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..200 {
                    let out = exe.execute(&[&da, &db]).unwrap();
                    assert_eq!(
                        out[0].to_host().unwrap().as_slice::<f32>().unwrap(),
                        &ADD_EXPECTED
                    );
                }
            });
        }
    });
}

/// Runs the stress test in a child process of its own, so that other tests (which load more
/// plugins and compile concurrently) do not move its RSS figures.
#[test]
fn stress_executes_and_compile_cycles_keep_memory_bounded() {
    if client_or_skip("stress_executes_and_compile_cycles_keep_memory_bounded").is_none() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "stress_in_own_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(
        out.status.success(),
        "the stress test failed in its own process"
    );
    assert!(stdout.contains("stress: "), "the stress test did not run");
}

#[test]
#[ignore = "run by stress_executes_and_compile_cycles_keep_memory_bounded in its own process"]
fn stress_in_own_process() {
    // The first call in this process: python3 discovery, dlopen, initialize, client.
    let t = Instant::now();
    let Some(client) = client_or_skip("stress_in_own_process") else {
        return;
    };
    let setup_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let digest = client.identity().unwrap().digest();
    println!(
        "first client (discovery + load + init + create): {setup_ms:.1} ms; identity {} \
         (hashing the plugin file): {:.1} ms",
        digest.short(),
        t.elapsed().as_secs_f64() * 1e3
    );
    let started = Instant::now();
    let exe = compile_add(client);
    let (a, b) = add_inputs();
    let (da, db) = (client.upload(&a).unwrap(), client.upload(&b).unwrap());
    // Warm up: first-execute passes, allocator pools, one compile.
    for _ in 0..200 {
        drop(exe.execute(&[&da, &db]).unwrap());
    }
    drop(compile_add(client));
    let rss0 = rss_bytes();

    const EXECUTES: usize = 10_000;
    let t = Instant::now();
    for i in 0..EXECUTES {
        let out = exe.execute(&[&da, &db]).unwrap();
        if i % 1000 == 0 {
            assert_eq!(
                out[0].to_host().unwrap().as_slice::<f32>().unwrap(),
                &ADD_EXPECTED
            );
        }
    }
    let exec_us = t.elapsed().as_secs_f64() * 1e6 / EXECUTES as f64;
    let rss1 = rss_bytes();

    let t = Instant::now();
    for _ in 0..200 {
        let e = compile_add(client);
        drop(e);
    }
    let compile_ms = t.elapsed().as_secs_f64() * 1e3 / 200.0;
    let rss2 = rss_bytes();

    let t = Instant::now();
    for _ in 0..1000 {
        let out = exe.execute_host(&[&a, &b]).unwrap();
        assert_eq!(out[0].as_slice::<f32>().unwrap(), &ADD_EXPECTED);
    }
    let host_us = t.elapsed().as_secs_f64() * 1e3;
    let mib = |x: u64| x as f64 / (1 << 20) as f64;
    println!(
        "stress: {EXECUTES} executes at {exec_us:.1} us each; 200 compile+destroy at {compile_ms:.2} ms each; \
         1000 upload+execute+download at {host_us:.1} us each; \
         RSS {:.1} MiB before, {:.1} MiB after executes, {:.1} MiB after compiles (growth {:.1} MiB); \
         total {:.1} s",
        mib(rss0),
        mib(rss1),
        mib(rss2),
        mib(rss2.saturating_sub(rss0)),
        started.elapsed().as_secs_f64()
    );
    assert!(
        rss2.saturating_sub(rss0) < 64 << 20,
        "RSS grew by {:.1} MiB",
        mib(rss2.saturating_sub(rss0))
    );
}

/// Input-type errors on XLA name the input's path, as the interpreter's do (they said `argN`).
#[test]
fn input_type_errors_name_the_input_path() {
    use nitro::backend::{self, interp, Backend};
    if client_or_skip("input_type_errors_name_the_input_path").is_none() {
        return;
    }
    let xla = backend::xla().unwrap();
    let inputs = vec![
        ("layers[0].w".to_owned(), f32_type(&[3, 2])),
        ("batch.x".to_owned(), f32_type(&[4, 3])),
    ];
    let graph = nitro::trace::trace(&inputs, |x| vec![x[1].matmul(x[0])]).unwrap();
    let text = nitro::emit::emit(&graph);
    let exe = xla.compile(&graph, &text).unwrap();
    let w = Array::zeros(DType::F32, &[3, 2]);
    let wrong_x = Array::zeros(DType::F32, &[5, 3]);

    let on_xla = exe.run(&[&w, &wrong_x]).unwrap_err();
    let on_interp = interp::run_refs(&graph, &[&w, &wrong_x]).unwrap_err();
    assert!(
        matches!(&on_xla, Error::InputType { index: 1, name, .. } if name == "batch.x"),
        "{on_xla}"
    );
    // The same words on both backends.
    assert_eq!(on_xla.to_string(), on_interp.to_string());
    assert!(
        on_xla.to_string().contains("input 1 (`batch.x`)"),
        "{on_xla}"
    );

    // Device buffers through the PJRT executable, and a wrong dtype.
    let pj = exe.as_pjrt().unwrap();
    assert_eq!(pj.input_names(), ["layers[0].w", "batch.x"]);
    let client = pj.client();
    let ints = client
        .upload(&Array::from_vec(&[3, 2], vec![1i32; 6]).unwrap())
        .unwrap();
    let x = client.upload(&Array::zeros(DType::F32, &[4, 3])).unwrap();
    let err = pj.execute(&[&ints, &x]).unwrap_err();
    assert!(err.to_string().contains("input 0 (`layers[0].w`)"), "{err}");

    // The names survive serialization, through the backend and through the bare client.
    let bytes = exe.serialize().unwrap();
    let loaded = xla.load(&bytes, &graph).unwrap();
    let err = loaded.run(&[&w, &wrong_x]).unwrap_err();
    assert!(err.to_string().contains("(`batch.x`)"), "{err}");
    let bare = client.deserialize(&bytes).unwrap();
    assert_eq!(bare.input_names(), ["layers[0].w", "batch.x"]);

    // A program compiled from text alone has no names: arguments are `argN`.
    let plain = client
        .compile(&text, &graph.input_types(), &graph.output_types())
        .unwrap();
    assert_eq!(plain.input_names(), ["arg0", "arg1"]);
    let err = plain.execute_host(&[&w, &wrong_x]).unwrap_err();
    assert!(err.to_string().contains("input 1 (`arg1`)"), "{err}");
}

/// A hand-built graph with a tensor over the size limit never reaches XLA (which aborted on
/// tensors over 2^63 bytes); traced graphs cannot hold one.
#[test]
fn hand_built_graphs_over_the_size_limit_are_refused_before_xla() {
    use nitro::backend::{self, Backend};
    use nitro::trace::{Graph, Op, ReduceOp};
    if client_or_skip("hand_built_graphs_over_the_size_limit_are_refused_before_xla").is_none() {
        return;
    }
    let mut g = Graph::default();
    let big = g.push(Op::Iota { axis: 0 }, vec![], f32_type(&[1 << 31, 1 << 31]));
    let sum = g.push(
        Op::Reduce {
            kind: ReduceOp::Sum,
            axes: vec![0, 1],
        },
        vec![big],
        f32_type(&[]),
    );
    g.outputs.push(sum);
    let text = nitro::emit::emit(&g);
    match backend::xla().unwrap().compile(&g, &text) {
        Err(Error::InvalidGraph {
            node: 0,
            op,
            message,
        }) => {
            assert_eq!(op, "iota");
            assert!(message.contains("f32[2147483648,2147483648]"), "{message}");
        }
        other => panic!("expected InvalidGraph, got {other:?}"),
    }
}

/// Runs the ignored test `name` in a child process of this test binary with `XLA_FLAGS` set
/// (the plugin reads it once per process), returning its status and output.
fn child_with_xla_flags(name: &str, flags: &str) -> (std::process::ExitStatus, String) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("XLA_FLAGS", flags)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

/// A flag the plugin does not know would end the process inside XLA (exit status 1, no
/// message); nitro refuses it first, naming the token.
#[test]
fn an_unknown_xla_flag_is_a_typed_error_not_a_silent_exit() {
    if client_or_skip("an_unknown_xla_flag_is_a_typed_error_not_a_silent_exit").is_none() {
        return;
    }
    let (status, out) = child_with_xla_flags(
        "xla_flags_child_refused",
        "--xla_cpu_enable_fast_math=false --xla_bogus_flag=1",
    );
    assert!(status.success(), "the child failed: {out}");
    assert!(out.contains("xla-flags: refused"), "{out}");
}

#[test]
#[ignore = "run by an_unknown_xla_flag_is_a_typed_error_not_a_silent_exit with XLA_FLAGS set"]
fn xla_flags_child_refused() {
    let err = pjrt::client().unwrap_err();
    assert!(
        matches!(err, Error::XlaFlags { ref why, .. } if why.contains("`--xla_bogus_flag=1`")),
        "{err}"
    );
    println!("xla-flags: refused: {err}");
}

/// XLA_FLAGS change the code XLA generates, so they are part of the backend identity: a
/// program compiled under them is never served to a process without them.
#[test]
fn xla_flags_are_part_of_the_backend_identity() {
    let Some(client) = client_or_skip("xla_flags_are_part_of_the_backend_identity") else {
        return;
    };
    let here = client.identity().unwrap().clone();
    let flags = "  --xla_backend_optimization_level=1   --xla_cpu_enable_fast_math=false ";
    let (status, out) = child_with_xla_flags("xla_flags_child_identity", flags);
    assert!(status.success(), "the child failed: {out}");
    let json = out
        .lines()
        .find_map(|l| l.split_once("xla-flags: identity ").map(|(_, json)| json))
        .unwrap_or_else(|| panic!("no identity line: {out}"));
    let there: pjrt::BackendIdentity = serde_json::from_str(json).unwrap();
    assert_eq!(
        there.xla_flags,
        "--xla_backend_optimization_level=1 --xla_cpu_enable_fast_math=false"
    );
    if std::env::var("XLA_FLAGS").is_err() {
        assert_eq!(here.xla_flags, "");
        assert_ne!(there.digest(), here.digest());
        let (name, ours, theirs) = here.first_difference(&there).unwrap();
        assert_eq!(name, "XLA_FLAGS");
        assert_eq!(ours, "\"\"");
        assert!(theirs.contains("optimization_level=1"), "{theirs}");
    }
}

#[test]
#[ignore = "run by xla_flags_are_part_of_the_backend_identity with XLA_FLAGS set"]
fn xla_flags_child_identity() {
    let client = pjrt::client().unwrap();
    // The flags were accepted: the plugin compiles and runs under them.
    let exe = compile_add(client);
    let (a, b) = add_inputs();
    let out = exe.execute_host(&[&a, &b]).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &ADD_EXPECTED);
    let identity = serde_json::to_string(client.identity().unwrap()).unwrap();
    println!("xla-flags: identity {identity}");
}
