"""The JAX twin of chargpt's generation (`nitro::generate`), for `bench/generate_bench.sh`.

It reads the bundle `generate_bench --write` makes (`weights.safetensors` by nitro leaf path,
`run.json` with the shape, the characters, the prompt buckets, the chunk size, the largest
top-k and the prompts) and generates the way a JAX serving loop does (JetStream's shape):

- `prefill` per prompt bucket: the prompt's forward pass (causal attention over the bucket
  only), its keys and values written into one slot of the static KV cache with
  `lax.dynamic_update_slice`, the first token sampled in the program; the cache donated;
- `decode` per slot count: a `lax.fori_loop` of `chunk` steps over every slot, each step one
  token per row through the cache (the new key and value scattered at the row's position, the
  attention masked past it), sampled in the program; the cache donated;
- sampling with `jax.random` in the program, every setting a traced per-row input: greedy
  (temperature 0), temperature, top-k up to the declared largest (`lax.top_k`) and top-p over
  the kept set, a per-row key with the token's draw count folded in;
- the programs compiled ahead (`jit(...).lower(...).compile()`) for the declared set, through
  JAX's persistent compilation cache (`--cache DIR`), so a warm start loads them.

Modes (`--mode`), each one JSON line, matching `generate_bench`'s:

- `measure`: the inventory (1 slot and `--slots` slots) compiled or loaded, the greedy text of
  the 32-character prompt, time to first token for the 32- and 120-character prompts (median
  of `--rounds` x 5), decode tokens/s at 1 and at all slots (median of `--rounds`);
- `start`: the 1-slot inventory, then the 32-character prompt's first token; prints its
  wall-clock time (`first_token_unix`), for the script to subtract its launch time.
  `--lazy` compiles only the prefill that token needs;
- `floor`: decode tokens/s at 1 slot (the bytes per token are computed by the script).

`--dump DIR` writes the decode chunk's lowered StableHLO and XLA's optimized HLO text there.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from safetensors.numpy import load_file

MASKED = -1e9
BLOCK_EPS = 1e-5

COMPILES = {"backend": 0, "cache_hits": 0}


def _count(event, *args, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        COMPILES["cache_hits"] += 1


def _count_duration(event, duration, *args, **kwargs):
    # Fired for every program that reached XLA, loaded from the persistent cache or not: a
    # compile is one of these that was not a cache hit.
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES["backend"] += 1


def compiles():
    return COMPILES["backend"] - COMPILES["cache_hits"]


jax.monitoring.register_event_listener(_count)
jax.monitoring.register_event_duration_secs_listener(_count_duration)


def parse():
    p = argparse.ArgumentParser(prog="twin_generate.py", description=__doc__.split("\n")[0])
    p.add_argument("bundle")
    p.add_argument("--mode", choices=["measure", "start", "floor"], default="measure")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--tokens", type=int, default=97)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache", metavar="DIR", help="JAX's persistent compilation cache")
    p.add_argument("--lazy", action="store_true", help="start: compile only the needed prefill")
    p.add_argument("--dump", metavar="DIR")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.cache:
        os.makedirs(args.cache, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(args.cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return args


class Model:
    def __init__(self, bundle):
        with open(os.path.join(bundle, "run.json")) as f:
            self.run = run = json.load(f)
        self.layers, self.width, self.heads = run["layers"], run["width"], run["heads"]
        self.context, self.vocab = run["context"], run["vocab"]
        self.dh = self.width // self.heads
        self.final_eps = float(run.get("ln_eps", 1e-5))
        self.buckets, self.chunk, self.max_k = run["buckets"], run["chunk"], run["max_top_k"]
        self.chars = run["chars"]
        self.ids = {c: i for i, c in enumerate(self.chars)}
        host = load_file(os.path.join(bundle, "weights.safetensors"))
        self.params = {k: jax.device_put(v) for k, v in host.items()}
        self.weight_bytes = sum(v.nbytes for v in host.values())

    def encode(self, text):
        return [self.ids[c] for c in text]

    def decode_text(self, ids):
        return "".join(self.chars[i] for i in ids)

    # ---- the model -----------------------------------------------------------------------

    @staticmethod
    def linear(p, name, x):
        return x @ p[name + ".w"] + p[name + ".b"]

    @staticmethod
    def layer_norm(p, name, x, eps):
        c = x - jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(c * c, axis=-1, keepdims=True)
        return c * lax.rsqrt(var + eps) * p[name + ".gain"] + p[name + ".bias"]

    def qkv(self, p, i, x):
        b, t, _ = x.shape
        pre = f"blocks[{i}].attention."
        split = lambda n: self.linear(p, pre + n, x).reshape(b, t, self.heads, self.dh).transpose(0, 2, 1, 3)
        return split("q"), split("k"), split("v")

    def attend_out(self, p, i, h, out):
        b, _, t, _ = out.shape
        pre = f"blocks[{i}]."
        h = h + self.linear(p, pre + "attention.o", out.transpose(0, 2, 1, 3).reshape(b, t, self.width))
        m = self.linear(p, pre + "fc1", self.layer_norm(p, pre + "ln2", h, BLOCK_EPS))
        return h + self.linear(p, pre + "fc2", jax.nn.gelu(m, approximate=False))

    def head(self, p, h):
        return self.linear(p, "head", self.layer_norm(p, "norm", h, self.final_eps))

    # ---- sampling -------------------------------------------------------------------------

    def sample(self, logits, keys, drawn, temperature, top_k, top_p):
        """One token per row of `logits` [rows, vocab]; every setting per row, traced."""
        logits = logits.astype(jnp.float32)
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
        z = (logits - jnp.max(logits, axis=-1, keepdims=True)) / t
        k = min(self.max_k, self.vocab)
        vals, _ = lax.top_k(z, k)  # descending
        kk = jnp.clip(top_k, 1, k)
        kth = jnp.take_along_axis(vals, (kk - 1)[:, None], axis=-1)
        z = jnp.where((top_k[:, None] > 0) & (z < kth), -jnp.inf, z)
        # top-p over the kept set: the smallest prefix of the sorted kept values reaching p.
        kept_vals = jnp.where((top_k[:, None] > 0) & (jnp.arange(k)[None, :] >= kk[:, None]), -jnp.inf, vals)
        probs = jax.nn.softmax(jnp.where(top_k[:, None] > 0, kept_vals, vals), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        cut = jnp.min(jnp.where(before < top_p[:, None], kept_vals, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where((top_p[:, None] < 1.0) & (top_k[:, None] > 0) & (z < cut), -jnp.inf, z)
        row_keys = jax.vmap(jax.random.fold_in)(keys, drawn)
        drawn_tok = jax.vmap(jax.random.categorical)(row_keys, z).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn_tok, greedy)

    # ---- the programs ---------------------------------------------------------------------

    def prefill(self, p, cache, tokens, slot, length, keys, drawn, temperature, top_k, top_p):
        """tokens [1, bucket]; cache: per layer (k, v) [slots, heads, context, dh]."""
        t = tokens.shape[1]
        h = p["tokens.table"][tokens] + p["positions.table"][:t][None]
        causal = jnp.tril(jnp.ones((t, t), bool))
        new_cache = []
        for i in range(self.layers):
            x = self.layer_norm(p, f"blocks[{i}].ln1", h, BLOCK_EPS)
            q, k, v = self.qkv(p, i, x)
            s = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(self.dh), MASKED)
            h = self.attend_out(p, i, h, jax.nn.softmax(s, axis=-1) @ v)
            ck, cv = cache[i]
            zero = jnp.int32(0)
            new_cache.append((lax.dynamic_update_slice(ck, k.astype(ck.dtype), (slot, zero, zero, zero)),
                              lax.dynamic_update_slice(cv, v.astype(cv.dtype), (slot, zero, zero, zero))))
        last = lax.dynamic_slice(h, (0, length - 1, 0), (1, 1, self.width))[:, 0]
        token = self.sample(self.head(p, last), keys, drawn, temperature, top_k, top_p)
        return new_cache, token

    def step(self, p, cache, last, pos):
        """One token per row: last [rows], pos [rows] -> logits [rows, vocab], cache."""
        rows = last.shape[0]
        h = (p["tokens.table"][last] + p["positions.table"][pos])[:, None]
        rr = jnp.arange(rows)
        visible = (jnp.arange(self.context)[None, :] <= pos[:, None])[:, None, None, :]
        new_cache = []
        for i in range(self.layers):
            x = self.layer_norm(p, f"blocks[{i}].ln1", h, BLOCK_EPS)
            q, k, v = self.qkv(p, i, x)  # [rows, heads, 1, dh]
            ck, cv = cache[i]
            ck = ck.at[rr, :, pos].set(k[:, :, 0].astype(ck.dtype))
            cv = cv.at[rr, :, pos].set(v[:, :, 0].astype(cv.dtype))
            s = jnp.where(visible, q @ ck.transpose(0, 1, 3, 2) / math.sqrt(self.dh), MASKED)
            h = self.attend_out(p, i, h, jax.nn.softmax(s, axis=-1) @ cv)
            new_cache.append((ck, cv))
        return self.head(p, h[:, 0]), new_cache

    def decode(self, p, cache, last, pos, keys, drawn, temperature, top_k, top_p):
        rows = last.shape[0]

        def body(j, carry):
            cache, last, pos, drawn, out = carry
            logits, cache = self.step(p, cache, last, pos)
            tok = self.sample(logits, keys, drawn, temperature, top_k, top_p)
            out = lax.dynamic_update_slice(out, tok[:, None], (jnp.int32(0), j))
            return cache, tok, pos + 1, drawn + 1, out

        out = jnp.zeros((rows, self.chunk), jnp.int32)
        return lax.fori_loop(0, self.chunk, body, (cache, last, pos, drawn, out))

    # ---- compiled inventory ---------------------------------------------------------------

    def cache_shape(self, slots):
        s = jax.ShapeDtypeStruct((slots, self.heads, self.context, self.dh), jnp.float32)
        return [(s, s) for _ in range(self.layers)]

    def new_cache(self, slots):
        z = lambda: jax.device_put(np.zeros((slots, self.heads, self.context, self.dh), np.float32))
        return [(z(), z()) for _ in range(self.layers)]

    def compile_prefill(self, slots, bucket):
        sd = jax.ShapeDtypeStruct
        i32, u32, f32 = jnp.int32, jnp.uint32, jnp.float32
        pshape = {k: sd(v.shape, v.dtype) for k, v in self.params.items()}
        return jax.jit(self.prefill, donate_argnums=(1,)).lower(
            pshape, self.cache_shape(slots), sd((1, bucket), i32), sd((), i32), sd((), i32),
            sd((1, 2), u32), sd((1,), u32), sd((1,), f32), sd((1,), i32), sd((1,), f32)).compile()

    def lower_decode(self, slots):
        sd = jax.ShapeDtypeStruct
        i32, u32, f32 = jnp.int32, jnp.uint32, jnp.float32
        pshape = {k: sd(v.shape, v.dtype) for k, v in self.params.items()}
        r = lambda dt: sd((slots,), dt)
        return jax.jit(self.decode, donate_argnums=(1,)).lower(
            pshape, self.cache_shape(slots), r(i32), r(i32), sd((slots, 2), u32), r(u32), r(f32),
            r(i32), r(f32))


class Generator:
    """A fixed set of slots over one static cache, with the compiled programs."""

    def __init__(self, m, slots, lazy_bucket=None):
        self.m, self.slots = m, slots
        buckets = [lazy_bucket] if lazy_bucket else m.buckets
        self.prefill = {b: m.compile_prefill(slots, b) for b in buckets}
        self.decode = None if lazy_bucket else m.lower_decode(slots).compile()
        self.cache = m.new_cache(slots)

    def bucket(self, n):
        return next(b for b in sorted(self.prefill) if b >= n)

    def first_token(self, prompt, slot=0, temperature=0.0, top_k=0, top_p=1.0, seed=0):
        b = self.bucket(len(prompt))
        toks = np.zeros((1, b), np.int32)
        toks[0, :len(prompt)] = prompt
        key = np.array([[seed >> 32, seed & 0xFFFFFFFF]], np.uint32)  # jax.random.PRNGKey(seed)'s data
        self.cache, tok = self.prefill[b](
            self.m.params, self.cache, toks, np.int32(slot), np.int32(len(prompt)), key,
            np.zeros(1, np.uint32), np.array([temperature], np.float32), np.array([top_k], np.int32),
            np.array([top_p], np.float32))
        return int(np.asarray(tok)[0])

    def generate(self, prompts, tokens):
        """Greedy: each prompt into its slot, then decode chunks until `tokens` per row. The
        rows' tokens and the decode time (from the last first token to the end)."""
        rows = len(prompts)
        firsts = [self.first_token(p, slot=r) for r, p in enumerate(prompts)]
        t0 = time.perf_counter()
        s = self.slots
        last = np.zeros(s, np.int32)
        last[:rows] = firsts
        pos = np.zeros(s, np.int32)
        pos[:rows] = [len(p) for p in prompts]
        keys = np.zeros((s, 2), np.uint32)
        drawn = np.ones(s, np.uint32)
        temp, top_k, top_p = np.zeros(s, np.float32), np.zeros(s, np.int32), np.ones(s, np.float32)
        outs = []
        last, pos, drawn = jax.device_put((last, pos, drawn))  # (jnp.asarray would compile a program)
        for _ in range(math.ceil((tokens - 1) / self.m.chunk)):
            self.cache, last, pos, drawn, out = self.decode(
                self.m.params, self.cache, last, pos, keys, drawn, temp, top_k, top_p)
            outs.append(np.asarray(out))  # streamed to the host every chunk
        took = time.perf_counter() - t0
        allout = np.concatenate(outs, axis=1)[:rows, :tokens - 1]
        return [[f] + list(map(int, row)) for f, row in zip(firsts, allout)], took


def ttft(g, prompt, n):
    g.first_token(prompt)
    v = []
    for _ in range(n):
        t = time.perf_counter()
        g.first_token(prompt)
        v.append((time.perf_counter() - t) * 1e3)
    return statistics.median(v)


def main():
    args = parse()
    m = Model(args.bundle)
    run = m.run
    if args.mode == "start":
        p32 = m.encode(run["prompt32"])
        g = Generator(m, 1, lazy_bucket=m.buckets[[b >= len(p32) for b in m.buckets].index(True)]
                      if args.lazy else None)
        g.first_token(p32)
        at = time.time()
        print(json.dumps({"side": "jax", "mode": "start", "lazy": args.lazy, "first_token_unix": at,
                          "compiles": compiles(), "cache_hits": COMPILES["cache_hits"]}))
        return
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        lowered = m.lower_decode(1 if args.mode == "floor" else args.slots)
        with open(os.path.join(args.dump, "jax_decode.stablehlo.txt"), "w") as f:
            f.write(lowered.as_text())
        with open(os.path.join(args.dump, "jax_decode.optimized_hlo.txt"), "w") as f:
            f.write(lowered.compile().as_text())
    p16 = m.encode(run["prompt16"])
    if args.mode == "floor":
        g = Generator(m, 1)
        made = compiles()
        g.generate([p16], 9)
        rates = []
        for _ in range(args.rounds):
            _, took = g.generate([p16], args.tokens)
            rates.append((args.tokens - 1) / took)
        print(json.dumps({"side": "jax", "mode": "floor", "compiles": made,
                          "decode_tokens_per_s_1": statistics.median(rates), "decode_runs": rates,
                          "weight_bytes": m.weight_bytes}))
        return
    started = time.perf_counter()
    one, many = Generator(m, 1), Generator(m, args.slots)
    warm_up = time.perf_counter() - started
    made, hits = compiles(), COMPILES["cache_hits"]
    p32, p120 = m.encode(run["prompt32"]), m.encode(run["prompt120"])
    greedy, _ = one.generate([p32], 64)
    one.generate([p16], 9)
    many.generate([p16] * args.slots, 9)
    t32, t120, d1, ds = [], [], [], []
    for _ in range(args.rounds):
        t32.append(ttft(one, p32, 5))
        t120.append(ttft(one, p120, 5))
        _, took = one.generate([p16], args.tokens)
        d1.append((args.tokens - 1) / took)
        _, took = many.generate([p16] * args.slots, args.tokens)
        ds.append(args.slots * (args.tokens - 1) / took)
    print(json.dumps({
        "side": "jax", "mode": "measure", "slots": args.slots, "compiles": made,
        "cache_hits": hits, "inventory": len(one.prefill) + len(many.prefill) + 2,
        "warm_up_ms": warm_up * 1e3, "greedy_text": m.decode_text(greedy[0]),
        "ttft32_ms": statistics.median(t32), "ttft120_ms": statistics.median(t120),
        "decode_tokens_per_s_1": statistics.median(d1), "decode_tokens_per_s_all": statistics.median(ds),
        "runs": {"ttft32": t32, "ttft120": t120, "decode1": d1, "decode_all": ds},
        "compiles_after_warm_up": compiles() - made,
    }))


if __name__ == "__main__":
    sys.exit(main())
