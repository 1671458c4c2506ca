"""The byte tokenizer: round trips, invalid UTF-8, ids out of range; a Tokenizer loaded as "bytes" is the same."""

import numpy as np
import pytest
import torch

from moe_dist.data.tokenizer import decode, encode, load_tokenizer


def test_decode_round_trips_and_replaces_invalid_utf8():
    assert decode(torch.from_numpy(encode("héllo").astype(np.int64))) == "héllo"
    assert decode([0xFF, 0x41]) == "\ufffdA"
    with pytest.raises(ValueError):
        decode([300])


def test_a_bytes_tokenizer_is_the_byte_tokenizer():
    tok = load_tokenizer("bytes")
    text = "déf f(x):\n\treturn x\0"
    assert tok.encode(text) == encode(text).tolist() and tok.vocab_size == 256 and tok.eos_id == 0
    assert tok.decode([0xFF, 0x41]) == decode([0xFF, 0x41]) == "\ufffdA"
    (ids,) = tok.encode_batch([text])
    assert ids.dtype == np.int64 and tok.decode(ids.tolist()) == text
