"""Codecs stay within their documented error bounds and decode into place."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from averaging.compression import choose
from p2p.codecs import BLOCK, Codec, cast_codec, decode_into, encode, error_bound


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(list(Codec)), st.integers(min_value=1, max_value=3 * BLOCK + 7),
       st.floats(min_value=1e-3, max_value=1e4), st.integers(min_value=0, max_value=2**31))
def test_decode_encode_is_within_the_documented_bound(codec, n, scale, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    out = torch.empty(n)
    decode_into(encode(codec, x), out)
    bound = error_bound(codec, x)
    assert (out - x).abs().max().item() <= bound * (1 + 1e-5) + 1e-6 * scale


@pytest.mark.parametrize("codec, big", [(Codec.FLOAT16, 1e6), (Codec.BFLOAT16, 3.4e38)])
def test_half_precision_falls_back_to_exact_above_its_range(codec, big):
    x = torch.tensor([big, -3.0, 0.5])
    payload = encode(codec, x)
    assert payload["c"] == "none"
    out = torch.empty(3)
    decode_into(payload, out)
    assert torch.equal(out, x)


def test_the_old_name_fp16_is_read_as_float16():
    assert Codec("fp16") is Codec.FLOAT16 and cast_codec("fp16") is Codec.FLOAT16
    x = torch.tensor([1.0, -3.0, 0.5])
    assert encode(Codec("fp16"), x)["c"] == "float16"
    out = torch.empty(3)
    decode_into({"c": "fp16", "d": x.half()}, out)
    assert torch.equal(out, x)


def test_only_casts_compress_whole_tensors():
    assert cast_codec(None) is Codec.NONE and cast_codec("bfloat16") is Codec.BFLOAT16
    for name in ("uniform8", "blockwise8", "zip", 3):
        with pytest.raises(ValueError, match="unknown compression"):
            cast_codec(name)


def test_blockwise_confines_an_outlier_to_its_block():
    x = torch.zeros(4 * BLOCK)
    x[:BLOCK] = torch.linspace(0, 1, BLOCK)
    x[-1] = 1000.0
    out = torch.empty_like(x)
    decode_into(encode(Codec.BLOCKWISE8, x), out)
    assert (out[:BLOCK] - x[:BLOCK]).abs().max() <= 1 / 510 + 1e-6  # untouched by the outlier
    decode_into(encode(Codec.UNIFORM8, x), out)
    assert (out[:BLOCK] - x[:BLOCK]).abs().max() > 0.1  # one range for all: the outlier costs everyone


def test_small_tensors_travel_exact_and_malformed_payloads_are_refused():
    assert choose(100, Codec.UNIFORM8) is Codec.NONE and choose(1 << 20, Codec.UNIFORM8) is Codec.UNIFORM8
    with pytest.raises(ValueError):
        decode_into({"c": "none", "d": torch.zeros(3)}, torch.empty(4))
    with pytest.raises(ValueError):
        decode_into({"c": "blockwise8", "d": torch.zeros(300, dtype=torch.uint8), "lo": torch.zeros(1),
                     "s": torch.ones(1)}, torch.empty(300))
    with pytest.raises(ValueError):
        decode_into("junk", torch.empty(1))
