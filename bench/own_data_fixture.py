"""Writes a small "bring your own data" fixture: the first 600 handwritten digits of
examples/data/digits.csv.gz as two .npy files, written by NumPy's own np.save. Run in any venv
with numpy, from anywhere:

    python3 bench/own_data_fixture.py

It writes, into docs/data/digits/ (created if missing, files mode 0644):

    x.npy  float32 [600, 8, 8, 1]  pixels / 16.0, in [0, 1], each row reshaped row-major to 8x8,
                                   with a trailing channel dim of 1 (channels last)
    y.npy  int32   [600]           labels 0..9

and prints the class counts and the files' sizes. Deterministic: the same bytes on every run
(for a given NumPy .npy format version).

The CSV has no header; each of its 1,797 rows is 64 integers 0..16 (an 8x8 image, row-major)
and then the label 0..9. See examples/data/README.md for the data set's source and license.
"""
import gzip
import os

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SRC = os.path.join(ROOT, "examples", "data", "digits.csv.gz")
OUT = os.path.join(ROOT, "docs", "data", "digits")
ROWS = 600


def read_rows(path, n):
    rows = []
    with gzip.open(path, "rt", encoding="ascii") as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            fields = line.split(",")
            if len(fields) != 65:
                raise SystemExit(f"{path}:{line_no}: expected 65 fields, found {len(fields)}")
            rows.append([int(v) for v in fields])
            if len(rows) == n:
                break
    if len(rows) != n:
        raise SystemExit(f"{path}: wanted {n} rows, found only {len(rows)}")
    return np.array(rows, dtype=np.int64)


def main():
    data = read_rows(SRC, ROWS)
    pixels, labels = data[:, :64], data[:, 64]
    if pixels.min() < 0 or pixels.max() > 16:
        raise SystemExit(f"pixel out of 0..16: min {pixels.min()}, max {pixels.max()}")
    if labels.min() < 0 or labels.max() > 9:
        raise SystemExit(f"label out of 0..9: min {labels.min()}, max {labels.max()}")

    x = (pixels.astype(np.float32) / np.float32(16.0)).reshape(ROWS, 8, 8, 1)
    y = labels.astype(np.int32)
    assert x.dtype == np.float32 and x.shape == (ROWS, 8, 8, 1)
    assert y.dtype == np.int32 and y.shape == (ROWS,)

    os.makedirs(OUT, exist_ok=True)
    paths = []
    for name, a in (("x", x), ("y", y)):
        p = os.path.join(OUT, name + ".npy")
        np.save(p, a)
        os.chmod(p, 0o644)
        paths.append(p)

    print(f"numpy {np.__version__}")
    print(f"x: {x.dtype} {list(x.shape)}  min {x.min()} max {x.max()}")
    print(f"y: {y.dtype} {list(y.shape)}")
    counts = np.bincount(y, minlength=10)
    print("class counts: " + ", ".join(f"{c}: {int(k)}" for c, k in enumerate(counts)))
    for p in paths:
        print(f"{os.path.relpath(p, ROOT)}: {os.path.getsize(p)} bytes")


if __name__ == "__main__":
    main()
