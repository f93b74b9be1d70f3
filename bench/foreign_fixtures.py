"""Writes the small "foreign weights" fixtures: an Equinox CNN and a tiny GPT-2, each saved in the
names and layouts PyTorch / Hugging Face use, plus input/output pairs computed in JAX, so tests can
load these files into nitro models and compare logits without JAX or PyTorch installed.

Run in a throwaway venv outside the repository (these packages are not project dependencies):

    python3 -m venv /tmp/fixvenv
    /tmp/fixvenv/bin/pip install jax==0.10.2 equinox==0.13.8 safetensors==0.8.0 numpy==2.4.6
    /tmp/fixvenv/bin/python bench/foreign_fixtures.py

Versions used to produce the committed files: jax 0.10.2 (jaxlib 0.10.2), equinox 0.13.8,
safetensors 0.8.0, numpy 2.4.6, Python 3.11, CPU, float32.

Writes into runtime/tests/fixtures/weights/:

  equinox_cnn.safetensors     conv1.weight [4,1,3,3]  conv1.bias [4]
                              conv2.weight [6,4,3,3]  conv2.bias [6]
                              fc.weight [5,24]        fc.bias [5]          (PyTorch layouts)
      model on an unbatched [C,H,W] input, vmapped over the batch:
      Conv2d(1,4,k3,s1,p1) -> relu -> MaxPool2d(k2,s2) -> Conv2d(4,6,k3,s2,p1) -> relu
      -> ravel in C,H,W order (24) -> Linear(24,5)
  equinox_cnn_io.safetensors  x [3,1,8,8] f32, logits [3,5] f32

  gpt2_tiny.safetensors       Hugging Face GPT2Model names and layouts (Conv1D weights [in,out],
                              c_attn columns q|k|v, old-style h.{i}.attn.bias causal buffer
                              [1,1,16,16], no lm_head.weight): vocab 50, n_positions 16, n_embd 64,
                              n_layer 2, n_head 4, layer_norm_epsilon 1e-5, gelu_new
  gpt2_tiny_io.safetensors    ids [2,10] i32, logits [2,10,50] f32 (tied head: h @ wte.T)

Every value comes from fixed seeds. The script also checks each JAX result against a second,
independent NumPy (float64, loop-based) implementation and fails if they disagree.
"""
import math
import os

import jax

jax.config.update("jax_platforms", "cpu")

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "runtime", "tests",
                   "fixtures", "weights")
os.makedirs(OUT, exist_ok=True)


def save(tensors, name):
    path = os.path.join(OUT, name)
    save_file(tensors, path)
    os.chmod(path, 0o644)  # safetensors writes 0600


def f32(a):
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32))


# ----------------------------------------------------------------------------------------------
# 1, 2: Equinox CNN
# ----------------------------------------------------------------------------------------------

class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    pool: eqx.nn.MaxPool2d
    conv2: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 4, kernel_size=3, stride=1, padding=1, key=k1)
        self.pool = eqx.nn.MaxPool2d(kernel_size=2, stride=2)
        self.conv2 = eqx.nn.Conv2d(4, 6, kernel_size=3, stride=2, padding=1, key=k2)
        self.fc = eqx.nn.Linear(24, 5, key=k3)

    def __call__(self, x):  # x: [C, H, W]
        x = jax.nn.relu(self.conv1(x))
        x = self.pool(x)
        x = jax.nn.relu(self.conv2(x))
        return self.fc(jnp.ravel(x))


def make_cnn():
    key = jax.random.PRNGKey(0)
    key, kb = jax.random.split(key)
    model = CNN(key)
    # Nonzero random biases, so a wrong bias mapping shows in the logits.
    b1, b2, b3 = jax.random.split(kb, 3)
    model = eqx.tree_at(lambda m: m.conv1.bias, model,
                        0.1 * jax.random.normal(b1, model.conv1.bias.shape, jnp.float32))
    model = eqx.tree_at(lambda m: m.conv2.bias, model,
                        0.1 * jax.random.normal(b2, model.conv2.bias.shape, jnp.float32))
    model = eqx.tree_at(lambda m: m.fc.bias, model,
                        0.1 * jax.random.normal(b3, model.fc.bias.shape, jnp.float32))
    return model


def cnn_reference_np(w, x):
    """Independent NumPy float64 forward from the PyTorch-layout tensors (explicit loops)."""
    def conv(x, wt, b, stride, pad):  # x [C,H,W], wt [O,I,kh,kw]
        c, h, wd = x.shape
        o, i, kh, kw = wt.shape
        xp = np.zeros((c, h + 2 * pad, wd + 2 * pad))
        xp[:, pad:pad + h, pad:pad + wd] = x
        ho = (h + 2 * pad - kh) // stride + 1
        wo = (wd + 2 * pad - kw) // stride + 1
        y = np.zeros((o, ho, wo))
        for oc in range(o):
            for r in range(ho):
                for s in range(wo):
                    patch = xp[:, r * stride:r * stride + kh, s * stride:s * stride + kw]
                    y[oc, r, s] = np.sum(patch * wt[oc]) + b[oc]
        return y

    def maxpool2(x):
        c, h, wd = x.shape
        return x.reshape(c, h // 2, 2, wd // 2, 2).max(axis=(2, 4))

    out = []
    for n in range(x.shape[0]):
        a = np.maximum(conv(x[n].astype(np.float64), w["conv1.weight"], w["conv1.bias"], 1, 1), 0)
        a = maxpool2(a)
        a = np.maximum(conv(a, w["conv2.weight"], w["conv2.bias"], 2, 1), 0)
        out.append(w["fc.weight"].astype(np.float64) @ a.reshape(-1) + w["fc.bias"])
    return np.stack(out)


def write_cnn():
    model = make_cnn()
    weights = {
        "conv1.weight": f32(model.conv1.weight),
        "conv1.bias": f32(model.conv1.bias).reshape(-1),
        "conv2.weight": f32(model.conv2.weight),
        "conv2.bias": f32(model.conv2.bias).reshape(-1),
        "fc.weight": f32(model.fc.weight),
        "fc.bias": f32(model.fc.bias),
    }
    expect = {"conv1.weight": (4, 1, 3, 3), "conv1.bias": (4,), "conv2.weight": (6, 4, 3, 3),
              "conv2.bias": (6,), "fc.weight": (5, 24), "fc.bias": (5,)}
    for k, s in expect.items():
        assert weights[k].shape == s, (k, weights[k].shape, s)
    for k in ("conv1.bias", "conv2.bias", "fc.bias"):
        assert np.all(weights[k] != 0), k

    x = f32(np.random.default_rng(1).standard_normal((3, 1, 8, 8)))
    logits = f32(jax.jit(jax.vmap(model))(jnp.asarray(x)))
    assert logits.shape == (3, 5)

    ref = cnn_reference_np(weights, x)
    err = np.max(np.abs(ref - logits))
    assert err < 1e-5, f"CNN: JAX vs NumPy reference differ by {err}"

    save(weights, "equinox_cnn.safetensors")
    save({"x": x, "logits": logits}, "equinox_cnn_io.safetensors")
    print(f"equinox_cnn: max|logits| = {np.max(np.abs(logits)):.6f}  (JAX vs NumPy ref {err:.2e})")


# ----------------------------------------------------------------------------------------------
# 3, 4: tiny GPT-2
# ----------------------------------------------------------------------------------------------

VOCAB, NPOS, D, NLAYER, NHEAD, EPS = 50, 16, 64, 2, 4, 1e-5
HD = D // NHEAD


def make_gpt2():
    rng = np.random.default_rng(2024)

    def normal(shape, std):
        return f32(rng.standard_normal(shape) * std)

    def ln_w():
        return f32(1.0 + rng.standard_normal(D) * 0.1)

    def ln_b():
        return f32(rng.standard_normal(D) * 0.1)

    w = {"wte.weight": normal((VOCAB, D), 0.02), "wpe.weight": normal((NPOS, D), 0.01)}
    for i in range(NLAYER):
        p = f"h.{i}."
        w[p + "ln_1.weight"] = ln_w()
        w[p + "ln_1.bias"] = ln_b()
        w[p + "attn.c_attn.weight"] = normal((D, 3 * D), 0.02)
        w[p + "attn.c_attn.bias"] = normal((3 * D,), 0.02)
        w[p + "attn.c_proj.weight"] = normal((D, D), 0.02)
        w[p + "attn.c_proj.bias"] = normal((D,), 0.02)
        w[p + "ln_2.weight"] = ln_w()
        w[p + "ln_2.bias"] = ln_b()
        w[p + "mlp.c_fc.weight"] = normal((D, 4 * D), 0.02)
        w[p + "mlp.c_fc.bias"] = normal((4 * D,), 0.02)
        w[p + "mlp.c_proj.weight"] = normal((4 * D, D), 0.02)
        w[p + "mlp.c_proj.bias"] = normal((D,), 0.02)
        w[p + "attn.bias"] = f32(np.tril(np.ones((NPOS, NPOS))).reshape(1, 1, NPOS, NPOS))
    w["ln_f.weight"] = ln_w()
    w["ln_f.bias"] = ln_b()
    return w


def gpt2_forward_jax(w, ids):
    w = {k: jnp.asarray(v) for k, v in w.items()}
    B, T = ids.shape

    def ln(x, g, b):
        mu = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + EPS) * g + b

    def gelu_new(x):
        return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))

    def heads(t):  # [B,T,D] -> [B,H,T,hd]
        return t.reshape(B, T, NHEAD, HD).transpose(0, 2, 1, 3)

    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    h = w["wte.weight"][ids] + w["wpe.weight"][jnp.arange(T)]
    for i in range(NLAYER):
        p = f"h.{i}."
        a = ln(h, w[p + "ln_1.weight"], w[p + "ln_1.bias"])
        qkv = a @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = jnp.split(qkv, 3, axis=-1)
        q, k, v = heads(q), heads(k), heads(v)
        s = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(HD)
        s = jnp.where(causal, s, jnp.float32(-1e9))
        att = jax.nn.softmax(s, axis=-1) @ v  # [B,H,T,hd]
        att = att.transpose(0, 2, 1, 3).reshape(B, T, D)
        h = h + (att @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"])
        m = ln(h, w[p + "ln_2.weight"], w[p + "ln_2.bias"])
        m = gelu_new(m @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        h = h + (m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"])
    h = ln(h, w["ln_f.weight"], w["ln_f.bias"])
    return h @ w["wte.weight"].T


def gpt2_reference_np(w, ids):
    """Independent NumPy float64 forward: one sequence and one head at a time, explicit loops
    over positions, so a transpose or head-split slip in the JAX version would show."""
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def ln(x, g, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + EPS) * g + b

    def gelu_new(x):
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))

    out = []
    for seq in ids:
        T = len(seq)
        h = np.stack([w["wte.weight"][t] + w["wpe.weight"][pos] for pos, t in enumerate(seq)])
        for i in range(NLAYER):
            p = f"h.{i}."
            a = ln(h, w[p + "ln_1.weight"], w[p + "ln_1.bias"])
            qkv = a @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
            mask = w[p + "attn.bias"][0, 0]
            att = np.zeros((T, D))
            for hh in range(NHEAD):
                q = qkv[:, 0 * D + hh * HD:0 * D + (hh + 1) * HD]
                k = qkv[:, 1 * D + hh * HD:1 * D + (hh + 1) * HD]
                v = qkv[:, 2 * D + hh * HD:2 * D + (hh + 1) * HD]
                for t in range(T):
                    allowed = [u for u in range(T) if mask[t, u] == 1.0]
                    sc = np.array([q[t] @ k[u] for u in allowed]) / np.sqrt(HD)
                    pr = np.exp(sc - sc.max())
                    pr /= pr.sum()
                    att[t, hh * HD:(hh + 1) * HD] = sum(pr[j] * v[u] for j, u in enumerate(allowed))
            h = h + att @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
            m = ln(h, w[p + "ln_2.weight"], w[p + "ln_2.bias"])
            m = gelu_new(m @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
            h = h + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
        h = ln(h, w["ln_f.weight"], w["ln_f.bias"])
        out.append(h @ w["wte.weight"].T)
    return np.stack(out)


def write_gpt2():
    w = make_gpt2()
    assert len(w) == 2 + NLAYER * 13 + 2 and "lm_head.weight" not in w
    ids = np.random.default_rng(7).integers(0, VOCAB, size=(2, 10)).astype(np.int32)
    logits = f32(jax.jit(gpt2_forward_jax)(w, jnp.asarray(ids)))
    assert logits.shape == (2, 10, VOCAB)

    ref = gpt2_reference_np(w, ids)
    err = np.max(np.abs(ref - logits))
    assert err < 1e-4, f"GPT-2: JAX vs NumPy reference differ by {err}"

    try:  # optional cross-check; never installed by this script
        import torch  # noqa: F401
        import transformers  # noqa: F401
        print("note: torch/transformers importable, but the HF cross-check is not wired up")
    except ImportError:
        pass

    save(w, "gpt2_tiny.safetensors")
    save({"ids": np.ascontiguousarray(ids), "logits": logits}, "gpt2_tiny_io.safetensors")
    print(f"gpt2_tiny:   max|logits| = {np.max(np.abs(logits)):.6f}  (JAX vs NumPy ref {err:.2e})")


if __name__ == "__main__":
    print(f"jax {jax.__version__}, equinox {eqx.__version__}, numpy {np.__version__}")
    write_cnn()
    write_gpt2()
