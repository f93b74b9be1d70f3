"""What JAX 0.10.2 hands to XLA for SPMD-partitioned programs on CPU host devices.

A throwaway spike, not part of nitro's build. Run it from any directory with a JAX venv:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
        /tmp/fixvenv/bin/python bench/spmd_spike.py [OUT_DIR]

(both variables are set by the script itself if absent). OUT_DIR defaults to
`bench/spmd_spike/` next to this file. For every case and for both partitioner settings
(`jax_use_shardy_partitioner` True = "sdy", False = "gspmd") it writes

    CASE.VARIANT.stablehlo.mlir      `jax.jit(...).lower(...).as_text()`
    CASE.VARIANT.compiled.hlo.txt    `.compile().as_text()` (the HLO after SPMD partitioning)
    CASE.VARIANT.compile_options.txt the CompileOptions JAX actually passed to the backend
                                     (captured by wrapping `compiler.backend_compile_and_load`):
                                     fields, the serialized proto as hex and decoded by field
                                     number, and whether the module JAX passed equals the text

and prints, per case, the output shardings and per-device shard shapes of a real run, a check
against a numpy reference, and the collectives found in the partitioned HLO. At the end it
compiles the lowered *text* itself (as nitro would hand text to a PJRT plugin) with hand-made
minimal CompileOptionsProto bytes (spmd; +use_shardy_partitioner; +device_assignment;
+allow_spmd_sharding_propagation_to_output; no spmd flag), runs each result on the same sharded
inputs and prints which option sets compile, the per-device parameter shapes and the shardings
the executables report, and whether the numbers match; that matrix also goes to
`own_options.txt`, and everything printed goes to `run_log.txt`. FINDINGS.md there is written by
hand from these files.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re  # noqa: E402

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from jax._src import compiler  # noqa: E402
from jax._src.lib import xla_client as xc  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "spmd_spike")
MAX_CHARS = 20000

# ---------------------------------------------------------------------------------------------
# Protobuf wire-format decoding (field numbers from xla/pjrt/proto/compile_options.proto and
# xla/xla_data.proto), enough to show exactly which bytes JAX sends.
COMPILE_OPTIONS_FIELDS = {
    1: "argument_layouts", 2: "parameter_is_tupled_arguments", 3: "executable_build_options",
    4: "compile_portable_executable", 5: "profile_version", 6: "serialized_multi_slice_config",
    7: "env_option_overrides", 8: "target_config", 9: "allow_in_place_mlir_modification",
    10: "matrix_unit_operand_precision", 11: "compiler_variant",
}
BUILD_OPTIONS_FIELDS = {
    1: "device_ordinal", 2: "result_layout", 3: "debug_options", 4: "num_replicas",
    5: "num_partitions", 6: "use_spmd_partitioning", 7: "use_auto_spmd_partitioning",
    8: "deduplicate_hlo", 9: "device_assignment", 10: "alias_passthrough_params",
    11: "run_backend_only", 12: "allow_spmd_sharding_propagation_to_output", 13: "comp_envs",
    14: "fdo_profile", 15: "device_memory_size", 16: "auto_spmd_partitioning_mesh_shape",
    17: "auto_spmd_partitioning_mesh_ids", 18: "allow_spmd_sharding_propagation_to_parameters",
    19: "use_shardy_partitioner", 20: "exec_time_optimization_effort",
    21: "memory_fitting_effort", 22: "process_index", 23: "process_count",
    24: "optimization_level", 25: "memory_fitting_level", 26: "slice_size",
}
DEVICE_ASSIGNMENT_FIELDS = {1: "replica_count", 2: "computation_count", 3: "computation_devices"}
COMPUTATION_DEVICE_FIELDS = {1: "replica_device_ids"}
NESTED = {
    ("CompileOptionsProto", 3): ("ExecutableBuildOptionsProto", BUILD_OPTIONS_FIELDS),
    ("ExecutableBuildOptionsProto", 9): ("DeviceAssignmentProto", DEVICE_ASSIGNMENT_FIELDS),
    ("DeviceAssignmentProto", 3): ("ComputationDevice", COMPUTATION_DEVICE_FIELDS),
}


def _varint(b, i):
    v = shift = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return v, i


def decode(b, msg="CompileOptionsProto", names=COMPILE_OPTIONS_FIELDS, indent=""):
    out, i = [], 0
    while i < len(b):
        key, i = _varint(b, i)
        field, wt = key >> 3, key & 7
        name = names.get(field, "?")
        if wt == 0:
            v, i = _varint(b, i)
            out.append(f"{indent}{field} {name} (varint) = {v}")
        elif wt == 5:
            v = np.frombuffer(b[i:i + 4], "<f4")[0]
            i += 4
            out.append(f"{indent}{field} {name} (fixed32) = {v}")
        elif wt == 1:
            v = np.frombuffer(b[i:i + 8], "<f8")[0]
            i += 8
            out.append(f"{indent}{field} {name} (fixed64) = {v}")
        elif wt == 2:
            n, i = _varint(b, i)
            body = b[i:i + n]
            i += n
            sub = NESTED.get((msg, field))
            if sub:
                out.append(f"{indent}{field} {name} (message {sub[0]}, {n} bytes) {{")
                out += decode(body, sub[0], sub[1], indent + "  ")
                out.append(f"{indent}}}")
            elif name in ("allow_spmd_sharding_propagation_to_output",
                          "allow_spmd_sharding_propagation_to_parameters", "replica_device_ids"):
                vals, j = [], 0
                while j < len(body):
                    v, j = _varint(body, j)
                    vals.append(v)
                out.append(f"{indent}{field} {name} (packed varints) = {vals}")
            else:
                out.append(f"{indent}{field} {name} (bytes/message, {n} bytes) = {body.hex()}")
        else:
            out.append(f"{indent}{field} ? wire type {wt} (stop)")
            break
    return out


def describe_options(opts):
    bo = opts.executable_build_options
    da = opts.device_assignment
    lines = [
        f"num_replicas = {opts.num_replicas}",
        f"num_partitions = {opts.num_partitions}",
        f"parameter_is_tupled_arguments = {opts.parameter_is_tupled_arguments}",
        f"compile_portable_executable = {opts.compile_portable_executable}",
        f"profile_version = {opts.profile_version}",
        f"env_option_overrides = {opts.env_option_overrides}",
        f"argument_layouts = {opts.argument_layouts}",
        f"device_assignment = {None if da is None else da.serialize().hex() if hasattr(da, 'serialize') else da}",
        "executable_build_options:",
        f"  num_replicas = {bo.num_replicas}",
        f"  num_partitions = {bo.num_partitions}",
        f"  use_spmd_partitioning = {bo.use_spmd_partitioning}",
        f"  use_shardy_partitioner = {bo.use_shardy_partitioner}",
        f"  use_auto_spmd_partitioning = {bo.use_auto_spmd_partitioning}",
        f"  allow_spmd_sharding_propagation_to_parameters = {list(bo.allow_spmd_sharding_propagation_to_parameters)}",
        f"  allow_spmd_sharding_propagation_to_output = {list(bo.allow_spmd_sharding_propagation_to_output)}",
        f"  device_assignment = {bo.device_assignment}",
        f"  exec_time_optimization_effort = {bo.exec_time_optimization_effort}",
        f"  memory_fitting_effort = {bo.memory_fitting_effort}",
        f"  optimization_level = {bo.optimization_level}",
        f"  memory_fitting_level = {bo.memory_fitting_level}",
    ]
    raw = opts.SerializeAsString()
    lines += ["", f"SerializeAsString() ({len(raw)} bytes):", raw.hex(" "), "",
              "decoded by field number:"] + decode(raw)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Capture what JAX passes to the backend.
CAPTURED = []
_orig_compile = compiler.backend_compile_and_load


def _capture(backend, module, executable_devices, options, host_callbacks):
    CAPTURED.append((str(module), options))
    return _orig_compile(backend, module, executable_devices, options, host_callbacks)


compiler.backend_compile_and_load = _capture


# ---------------------------------------------------------------------------------------------
# The cases. Each returns (fn, in_shardings, out_shardings, args, numpy reference).
def cases():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    x4 = rng.standard_normal((4, 8)).astype(np.float32)
    w1 = rng.standard_normal((8, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 8)).astype(np.float32)
    xh = rng.standard_normal((8, 4)).astype(np.float32)
    devs = np.array(jax.devices()[:4])
    m_data = jax.sharding.Mesh(devs, ("data",))
    m_model = jax.sharding.Mesh(devs, ("model",))
    m_2d = jax.sharding.Mesh(devs.reshape(2, 2), ("data", "model"))

    def S(mesh, *spec):
        return NamedSharding(mesh, P(*spec))

    def f(w, x):
        return jnp.tanh(x @ w).sum()

    def g(w1, w2, x):
        return jax.nn.relu(x @ w1) @ w2

    def h(x):
        return jax.lax.with_sharding_constraint(x * 2, S(m_data, "data")) + 1

    t = np.tanh(x4 @ w)
    g_ref = np.maximum(x4 @ w1, 0) @ w2
    return {
        "a_fsdp_fwd": (f, (S(m_data, "data", None), S(m_data, "data", None)), S(m_data),
                       (w, x4), t.sum()),
        "a_fsdp_grad": (jax.grad(f), (S(m_data, "data", None), S(m_data, "data", None)),
                        S(m_data, "data", None), (w, x4), x4.T @ (1 - t * t)),
        "b_tp": (g, (S(m_model, None, "model"), S(m_model, "model", None), S(m_model)),
                 S(m_model), (w1, w2, x4), g_ref),
        # Same as b_tp, with out_shardings left unspecified (XLA may choose).
        "b_tp_out_unspecified": (g, (S(m_model, None, "model"), S(m_model, "model", None),
                                     S(m_model)), None, (w1, w2, x4), g_ref),
        "c_2d": (g, (S(m_2d, None, "model"), S(m_2d, "model", None), S(m_2d, "data", None)),
                 S(m_2d, "data", None), (w1, w2, x4), g_ref),
        # x replicated in and out, constrained to P("data") in between.
        "d_constraint": (h, (S(m_data),), S(m_data), (xh,), xh * 2 + 1),
        # Same with out_shardings unspecified: does the constraint propagate to the result?
        "d_constraint_out_unspecified": (h, (S(m_data),), None, (xh,), xh * 2 + 1),
    }


def clip(s):
    return s if len(s) <= MAX_CHARS else s[:MAX_CHARS] + f"\n... [truncated, {len(s)} chars]\n"


def hlo_summary(hlo):
    lines = []
    for ln in hlo.splitlines():
        s = ln.strip()
        if s.startswith("ENTRY") or s.startswith("HloModule") or re.search(
                r"\b(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(-start|-done)?\(", s):
            lines.append("    " + (s if len(s) < 400 else s[:400] + " ..."))
    return lines


def run_case(name, variant, spec, log):
    fn, ins, outs, args, ref = spec
    kw = {"in_shardings": ins}
    if outs is not None:
        kw["out_shardings"] = outs
    jitted = jax.jit(fn, **kw)
    dev_args = [jax.device_put(a, s) for a, s in zip(args, ins)]
    lowered = jitted.lower(*dev_args)
    text = lowered.as_text()
    n_before = len(CAPTURED)
    compiled = lowered.compile()
    assert len(CAPTURED) == n_before + 1, "expected exactly one backend compile"
    passed_text, opts = CAPTURED[-1]
    base = os.path.join(OUT, f"{name}.{variant}")
    with open(base + ".stablehlo.mlir", "w") as fh:
        fh.write(clip(text))
    hlo = compiled.as_text()
    with open(base + ".compiled.hlo.txt", "w") as fh:
        fh.write(clip(hlo))
    same = passed_text.strip() == text.strip()
    with open(base + ".compile_options.txt", "w") as fh:
        fh.write(f"# {name} ({variant}): CompileOptions JAX passed to backend.compile_and_load\n")
        fh.write(f"# jax_use_shardy_partitioner = {jax.config.jax_use_shardy_partitioner}\n")
        fh.write(f"# module passed to XLA == lowered.as_text(): {same}\n\n")
        fh.write(describe_options(opts) + "\n")
        if not same:
            fh.write("\n# module as passed to XLA:\n" + clip(passed_text))
    out = compiled(*dev_args)
    got = np.asarray(out)
    ok = np.allclose(got, ref, rtol=1e-5, atol=1e-5)
    log(f"  [{variant}] numpy match: {ok}; passed module == as_text(): {same}")
    log(f"    in  shardings: {[str(s.spec) for s in compiled.input_shardings[0]]}")
    def idx(i):
        return ",".join(f"{sl.start or 0}:{sl.stop if sl.stop is not None else ''}" for sl in i)
    for k, a in enumerate(dev_args):
        log(f"    arg{k} shards  : " + "; ".join(f"dev{sh.device.id}[{idx(sh.index)}]{tuple(sh.data.shape)}"
                                              for sh in a.addressable_shards))
    log(f"    out sharding : {out.sharding}")
    log("    out shards   : " + "; ".join(f"dev{sh.device.id}[{idx(sh.index)}]{tuple(sh.data.shape)}"
                                         for sh in out.addressable_shards))
    for ln in hlo_summary(hlo):
        log(ln)
    return text, dev_args, ref, out.sharding


# ---------------------------------------------------------------------------------------------
# Compile the lowered text ourselves with hand-made CompileOptionsProto bytes.
def _vi(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _fld(num, payload=None, varint=None):
    if varint is not None:
        return _vi(num << 3) + _vi(varint)
    return _vi(num << 3 | 2) + _vi(len(payload)) + payload


def own_options(n, spmd=True, shardy=None, assignment=False, prop_out=False):
    """executable_build_options { num_replicas:1 num_partitions:n [use_spmd_partitioning]
    [device_assignment {replica_count:1 computation_count:n computation_devices{replica_device_ids:[i]}...}]
    [allow_spmd_sharding_propagation_to_output: [true]] [use_shardy_partitioner] }, the fields in field-number order
    (as protobuf serializes them), so the bytes round-trip through CompileOptions unchanged."""
    bo = _fld(4, varint=1) + _fld(5, varint=n)
    if spmd:
        bo += _fld(6, varint=1)
    if assignment:
        da = _fld(1, varint=1) + _fld(2, varint=n)
        for i in range(n):
            da += _fld(3, _fld(1, _vi(i)))  # repeated int64, packed (proto3 default)
        bo += _fld(9, da)
    if prop_out:
        bo += _fld(12, _vi(1))  # repeated bool, packed; one value applies to every output
    if shardy is not None:
        bo += _fld(19, varint=int(shardy))
    return _fld(3, bo)


def own_matrix(texts, log):
    backend = jax.devices()[0].client
    devs = jax.devices()[:4]
    sets = {
        "spmd": dict(spmd=True),
        "spmd+shardy": dict(spmd=True, shardy=True),
        "spmd+shardy+assignment": dict(spmd=True, shardy=True, assignment=True),
        "spmd+prop_out": dict(spmd=True, prop_out=True),
        "spmd+shardy+prop_out": dict(spmd=True, shardy=True, prop_out=True),
        "no spmd flag": dict(spmd=False),
    }
    fh = open(os.path.join(OUT, "own_options.txt"), "w")
    fh.write("# The lowered text compiled with hand-made CompileOptionsProto bytes "
             "(backend.compile_and_load(str, ...)), run on JAX's sharded inputs.\n\n")

    def emit(s):
        log(s)
        fh.write(s + "\n")
        fh.flush()

    for (name, variant), (text, dev_args, ref, jax_out_sharding) in texts.items():
        jax_out_shard_shape = jax_out_sharding.shard_shape(np.shape(ref))
        for label, kw in sets.items():
            raw = own_options(4, **kw)
            opts = xc.CompileOptions.ParseFromString(raw)  # a static method: returns new options
            assert opts.SerializeAsString() == raw
            emit(f"{name}.{variant} with [{label}] bytes {raw.hex(' ')}")
            try:
                exe = backend.compile_and_load(text, xc.DeviceList(tuple(devs)), opts)
            except Exception as e:  # noqa: BLE001
                emit("    compile FAILED: " + str(e).strip().splitlines()[0][:300])
                continue
            layout = re.search(r"entry_computation_layout=\{\((.*?)\)->",
                               exe.hlo_modules()[0].to_string())
            params = re.findall(r"(?:f32|s32|pred)\[[0-9,]*\]", layout.group(1) if layout else "")
            shards = [f"f32[{','.join(map(str, a.addressable_shards[0].data.shape))}]" for a in dev_args]
            psh = [str(xc.HloSharding.from_proto(sh)) for sh in exe.get_parameter_shardings() or []]
            osh = [str(xc.HloSharding.from_proto(sh)) for sh in exe.get_output_shardings() or []]
            emit(f"    compiled; per-device parameters {params}; parameter shardings {psh}; "
                 f"output shardings {osh}")
            if params != shards:
                emit(f"    not run: the executable wants {params}, JAX's shards are {shards}")
                continue
            try:
                res = exe.execute_sharded(dev_args)
                outs = res.disassemble_into_single_device_arrays()[0]
                shapes = [tuple(a.shape) for a in outs]
                if all(sh == np.shape(ref) for sh in shapes):  # replicated output
                    ok = all(np.allclose(np.asarray(a), ref, rtol=1e-5, atol=1e-5) for a in outs)
                    how = "replicated"
                else:
                    arr = jax.make_array_from_single_device_arrays(np.shape(ref), jax_out_sharding, outs)
                    ok = np.allclose(np.asarray(arr), ref, rtol=1e-5, atol=1e-5)
                    how = f"assembled as {jax_out_sharding.spec}"
                same = "same as JAX" if outs[0].shape == jax_out_shard_shape else "DIFFERS from JAX"
                emit(f"    run ok, per-device output shapes {shapes} ({same}), {how}, numpy match: {ok}")
            except Exception as e:  # noqa: BLE001
                emit("    run FAILED: " + str(e).strip().splitlines()[0][:300])
    fh.close()


def main():
    os.makedirs(OUT, exist_ok=True)
    log_lines = []

    def log(s):
        print(s, flush=True)
        log_lines.append(s)

    log(f"jax {jax.__version__}, devices {jax.devices()}")
    texts = {}
    for variant, shardy in (("sdy", True), ("gspmd", False)):
        try:
            jax.config.update("jax_use_shardy_partitioner", shardy)
        except Exception as e:  # noqa: BLE001
            log(f"cannot set jax_use_shardy_partitioner={shardy}: {e}")
            continue
        for name, spec in cases().items():  # fresh functions and meshes for every variant
            log(f"== {name}")
            try:
                texts[(name, variant)] = run_case(name, variant, spec, log)
            except Exception as e:  # noqa: BLE001
                log(f"  [{variant}] FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    jax.config.update("jax_use_shardy_partitioner", True)
    log("== own compile options on the lowered text")
    own_matrix(texts, log)
    with open(os.path.join(OUT, "run_log.txt"), "w") as fh:
        fh.write("\n".join(log_lines) + "\n")


if __name__ == "__main__":
    main()
