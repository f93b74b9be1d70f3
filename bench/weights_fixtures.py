"""Writes the PyTorch-style safetensors fixture runtime/tests/weights.rs loads (Python's
`safetensors` writer, the names and layouts torch uses), so CI checks nitro's import without
Python. Run in a throwaway venv with numpy and safetensors:

    python3 -m venv V && V/bin/pip install numpy safetensors && V/bin/python bench/weights_fixtures.py

With an argument, instead checks that a file nitro exported loads with safetensors.numpy and
prints its tensors: `V/bin/python bench/weights_fixtures.py exported.safetensors`.
"""
import os
import sys

import numpy as np
from safetensors.numpy import load_file, save_file

if len(sys.argv) > 1:
    for name, a in sorted(load_file(sys.argv[1]).items()):
        print(name, a.dtype, a.shape, a.ravel()[:4])
    sys.exit(0)

OUT = os.path.join(os.path.dirname(__file__), "..", "runtime", "tests", "fixtures", "weights")
os.makedirs(OUT, exist_ok=True)
tensors = {
    # torch.nn.Linear(4, 3): weight [out, in], bias [out].
    "fc.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 10,
    "fc.bias": np.array([0.5, -0.5, 1.0], dtype=np.float32),
    # torch.nn.Conv2d(1, 2, 3): weight OIHW [out, in, kh, kw].
    "conv.weight": np.arange(18, dtype=np.float32).reshape(2, 1, 3, 3) - 9,
    "conv.bias": np.array([1.0, 2.0], dtype=np.float32),
    # A buffer the model does not train (BatchNorm's counter): an extra tensor.
    "bn.num_batches_tracked": np.array(7, dtype=np.int64),
}
save_file(tensors, os.path.join(OUT, "torch_style.safetensors"))
print("wrote", sorted(tensors))
