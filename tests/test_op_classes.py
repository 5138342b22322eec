"""The ATen-op -> class table (data/op_classes.toml): one test per class, plus the rules."""

from __future__ import annotations

import pytest

from anatomist.anatomy import OpClass
from anatomist.op_classes import base_name, classify, is_known, is_view, lookup


@pytest.mark.parametrize("op", ["aten::mm", "aten::addmm.default", "aten::bmm", "aten::linear",
                                "aten::_scaled_dot_product_flash_attention_for_cpu",
                                "aten::_scaled_dot_product_efficient_attention_backward", "aten::convolution_backward"])
def test_contractions(op: str) -> None:
    assert classify(op) is OpClass.CONTRACTION


@pytest.mark.parametrize("op", ["aten::_softmax", "aten::softmax.int", "aten::native_layer_norm",
                                "aten::native_layer_norm_backward", "aten::_softmax_backward_data", "aten::rms_norm"])
def test_normalizations(op: str) -> None:
    assert classify(op) is OpClass.NORMALIZATION


@pytest.mark.parametrize("op", ["aten::add.Tensor", "aten::add_.Tensor", "aten::gelu", "aten::gelu_backward",
                                "aten::native_dropout", "aten::native_dropout_backward", "aten::tanh", "aten::silu"])
def test_elementwise(op: str) -> None:
    assert classify(op) is OpClass.ELEMENTWISE


@pytest.mark.parametrize("op", ["aten::_to_copy", "aten::copy_", "aten::embedding", "aten::embedding_dense_backward",
                                "aten::_foreach_addcdiv_.ScalarList", "aten::_fused_adamw_"])
def test_other(op: str) -> None:
    assert classify(op) is OpClass.OTHER
    assert is_known(op)


def test_unknown_op_is_other_and_reported_unknown() -> None:
    assert lookup("aten::some_new_op") is None
    assert classify("aten::some_new_op") is OpClass.OTHER
    assert not is_known("aten::some_new_op")


def test_base_name_and_views() -> None:
    assert base_name("aten::native_layer_norm.default") == "native_layer_norm"
    assert base_name("aten.add_.Tensor") == "add_"
    assert is_view("aten::view") and is_view("aten::t") and not is_view("aten::mm")
