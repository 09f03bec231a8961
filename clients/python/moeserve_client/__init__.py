"""Python client for moeserve. See client.py for the dtype conventions (BF16 = uint16 bits)."""

from .client import ForwardResult, MoeClient
from .dtypes import bf16_decode, bf16_encode, from_float32, to_float32
from .reference import random_inputs, reference_forward, relative_l2_error

__all__ = [
    "MoeClient", "ForwardResult", "bf16_encode", "bf16_decode", "to_float32", "from_float32",
    "reference_forward", "relative_l2_error", "random_inputs",
]
