"""BF16 / FP16 helpers on numpy arrays.

numpy has no bfloat16 of its own, so BF16 tensors are carried as ``uint16`` arrays of bit
patterns (or ``ml_dtypes.bfloat16`` arrays). The conversions are ml_dtypes': ``bf16_encode``
rounds float32 to nearest, ties to even (NaN stays NaN, Inf and signed zeros are kept);
``bf16_decode`` is exact. FP16 uses numpy's float16, whose float32 -> float16 cast also rounds
to nearest even.
"""

import ml_dtypes
import numpy as np

# Wire dtype names accepted by this package, with their numpy storage dtype (little-endian).
STORAGE = {
    "bf16": np.dtype("<u2"),
    "fp16": np.dtype("<f2"),
    "fp32": np.dtype("<f4"),
}

_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}


def normalize_dtype(name):
    """'bf16' | 'fp16' | 'fp32' from any accepted spelling (a string or a numpy dtype)."""
    key = name if isinstance(name, str) else np.dtype(name).name
    try:
        return _ALIASES[key.lower()]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of bf16, fp16, fp32") from None


def bf16_encode(x):
    """float array -> uint16 BF16 bit patterns, round to nearest, ties to even (ml_dtypes)."""
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16)
                                ).view(np.uint16)


def bf16_decode(bits):
    """uint16 BF16 bit patterns (or an ml_dtypes.bfloat16 array) -> float32, exact."""
    bits = np.asarray(bits)
    if bits.dtype == ml_dtypes.bfloat16:
        # Its bits as they are: asking for uint16 would convert the values (1.5 -> 1).
        bits = bits.view(np.uint16)
    return np.ascontiguousarray(bits, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def to_float32(array, dtype):
    """Values of ``array`` (stored as ``dtype``: bf16 patterns, fp16 or fp32) as float32."""
    dtype = normalize_dtype(dtype)
    if dtype == "bf16":
        return bf16_decode(array)
    return np.asarray(array).astype(np.float32)


def from_float32(values, dtype):
    """float values encoded (rounded to nearest even) as ``dtype``'s storage array."""
    dtype = normalize_dtype(dtype)
    if dtype == "bf16":
        return bf16_encode(values)
    return np.asarray(values, dtype=np.float32).astype(STORAGE[dtype])
