"""The fused FP8 linear's shared input quantization (``_SharedInput``): when an entry may be reused.

The cache is pure bookkeeping (identity, version counter, which copies it holds), so it is tested here on
CPU tensors; ``tests/gpu/test_quant_kernels.py`` checks on a GPU that sharing gives bit-identical outputs
and gradients.
"""

from __future__ import annotations

import gc

import torch

from fp8rl.quant import QuantSpec
from fp8rl.train.fp8_linear import _SharedInput


def test_an_entry_is_reused_only_for_the_same_unmodified_tensor_and_spec() -> None:
    cache, spec = _SharedInput(), QuantSpec()
    x, rowwise = torch.ones(4, 128), (torch.zeros(1), torch.zeros(1), None, None)
    cache.put(x, spec, rowwise)
    assert cache.get(x, spec, colwise=False) is rowwise
    assert cache.get(x, spec, colwise=True) is None  # the transposed copy was not made
    assert cache.get(x.clone(), spec, colwise=False) is None  # equal values, another tensor
    assert cache.get(x, QuantSpec(pow2_scales=not spec.pow2_scales), colwise=False) is None
    x.add_(1)
    assert cache.get(x, spec, colwise=False) is None  # modified in place since


def test_an_entry_dies_with_its_tensor_and_an_old_reference_cannot_clear_a_new_entry() -> None:
    cache, spec = _SharedInput(), QuantSpec()
    a, b = torch.ones(2, 128), torch.ones(2, 128)
    both = (torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1))
    cache.put(a, spec, both)
    cache.put(b, spec, both)
    del a
    gc.collect()
    assert cache.get(b, spec, colwise=True) is both  # a's death does not clear b's entry
    del b
    gc.collect()
    assert cache._ref is None and cache._value == ()
