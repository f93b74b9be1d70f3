"""Assembles the golden file a nitro test holds an example's model to: the bundle's initial
parameters, the first N steps' rows (and, for the character model, those steps' windows), the
schedule, and the losses the JAX twin computed on them.

    python bench/twin_golden.py BUNDLE LOSSES.npy OUT.safetensors

`LOSSES.npy` is what `twin_fashion.py` / `twin_chargpt.py` wrote with `--losses-out`; N is its
length. The extra tensors are named `twin.*` (the test loads the parameters with
`Import::allow_extra`):

- `twin.losses` f64 [N]; `twin.real` i32 [N];
- `twin.schedule` f64 [4]: base, min, warmup, total of the cosine schedule;
- fashion: `twin.batches` i32 [N, batch], rows of the Fashion-MNIST training set;
- chargpt: `twin.windows` i32 [N, batch, T + 1], the windows of each step in row order.
"""

import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file, save_file


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    bundle, losses_path, out = sys.argv[1:]
    run = json.load(open(os.path.join(bundle, "run.json")))
    losses = np.load(losses_path).astype(np.float64)
    n = len(losses)
    batches = np.load(os.path.join(bundle, "batches.npy"))[:n]
    real = np.load(os.path.join(bundle, "real.npy"))[:n].astype(np.int32)
    s = run["schedule"]
    tensors = dict(load_file(os.path.join(bundle, "init.safetensors")))
    tensors["twin.losses"] = losses
    tensors["twin.real"] = real
    tensors["twin.schedule"] = np.array([s["base"], s["min"], s["warmup"], s["total"]], np.float64)
    if run["model"] == "chargpt":
        train = np.load(os.path.join(bundle, "train.npy"))
        tensors["twin.windows"] = np.ascontiguousarray(train[batches]).astype(np.int32)
    else:
        tensors["twin.batches"] = batches.astype(np.int32)
    save_file(tensors, out)
    print(f"wrote {out}: {n} losses, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
