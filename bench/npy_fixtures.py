"""Writes the small .npy fixtures runtime/tests/npy.rs reads (NumPy's own writer), so CI checks
nitro's reader and writer against NumPy without NumPy. Run in any venv with numpy:

    python3 bench/npy_fixtures.py

Deterministic: the same bytes on every run.
"""
import os
import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "..", "runtime", "tests", "fixtures", "npy")
os.makedirs(OUT, exist_ok=True)

def save(name, a, **kw):
    np.save(os.path.join(OUT, name + ".npy"), a, **kw)

base = np.arange(6, dtype=np.float32).reshape(2, 3) * 0.5 - 1.0
save("f32_2x3", base)
save("f64_3", np.array([1.5, -2.25, 1e300], dtype=np.float64))
save("i32_2x2", np.array([[1, -2], [2**31 - 1, -2**31]], dtype=np.int32))
save("i64_scalar", np.array(-7, dtype=np.int64))
save("u8_4", np.array([0, 1, 200, 255], dtype=np.uint8))
save("u32_3", np.array([0, 1, 2**32 - 1], dtype=np.uint32))
save("bool_2x2", np.array([[True, False], [False, True]]))
save("f16_3", np.array([0.5, -1.0, 65504.0], dtype=np.float16))
save("f32_fortran_2x3", np.asfortranarray(base))
save("f32_empty_0x3", np.zeros((0, 3), dtype=np.float32))
save("f32_big_endian", base.astype(">f4"))
# Version 2.0 (a header length of four bytes), as np.lib.format writes for large headers.
with open(os.path.join(OUT, "f32_v2.npy"), "wb") as f:
    np.lib.format.write_array(f, base, version=(2, 0))
print("wrote", sorted(os.listdir(OUT)))
