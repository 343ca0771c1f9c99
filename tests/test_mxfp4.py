"""MXFP4 codec and checkpoint writer against transformers' own MXFP4 loader and dequantizer."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tes_grpo.experts.mxfp4 import (
    FP4_VALUES,
    dequantize_mxfp4,
    expert_param_to_mxfp4,
    fake_quantize_expert_param,
    from_hopper_layout,
    from_tile_order,
    hopper_shape,
    mxfp4_to_expert_param,
    padded_bytes,
    quantize_mxfp4,
    tile_order_shape,
    to_hopper_layout,
    to_tile_order,
)
from tes_grpo.experts.mxfp4_checkpoint import (
    MODULES_TO_NOT_CONVERT,
    SafetensorsCheckpoint,
    legacy_config_keys,
    save_tokenizer_files,
    write_config_json,
    write_mxfp4_checkpoint,
)


def tiny_config(vocab_size: int = 512) -> GptOssConfig:
    # expert dims are multiples of 32 so every row splits into whole MXFP4 blocks
    return GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab_size,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16, max_position_embeddings=256,
    )


def tiny_model(seed: int = 0) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_config()).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_bias"):  # random biases so their bf16 copy is checked too
                param.normal_(0, 0.02)
    return model


def test_every_fp4_code_round_trips_exactly():
    # one block holding each of the 16 FP4 values twice, scale 2**0; -0.0 reads back as 0
    values = torch.tensor(FP4_VALUES * 2).reshape(1, 32)
    blocks, scales = quantize_mxfp4(values)
    assert scales.tolist() == [[127]]
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), values)


def test_low_nibble_holds_the_even_element():
    values = torch.zeros(1, 32)
    values[0, 0], values[0, 1] = 0.5, 6.0  # codes 1 and 7 at scale 2**0 (block max 6)
    blocks, _ = quantize_mxfp4(values)
    assert blocks[0, 0, 0].item() == 0x71


def test_scale_is_smallest_exponent_that_fits_the_block_max():
    # max 7 needs 2**1 (7/2 = 3.5 <= 6), max 6 fits 2**0, max 0.75 fits 2**-3 (6); the all-zero block decodes to 0
    rows = torch.zeros(4, 32)
    rows[0, 3], rows[1, 3], rows[2, 3] = 7.0, -6.0, 0.75
    blocks, scales = quantize_mxfp4(rows)
    assert (scales.flatten().int() - 127).tolist()[:3] == [1, 0, -3]
    decoded = dequantize_mxfp4(blocks, scales, torch.float32)
    assert decoded[0, 3] == 8.0 and decoded[1, 3] == -6.0 and decoded[2, 3] == 0.75
    assert torch.equal(decoded[3], torch.zeros(32))


def test_rounds_to_nearest_with_ties_to_even():
    # block max 6 keeps scale 2**0; ties 0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4 (even codes); 2.6 -> 3
    row = torch.tensor([6.0, 0.25, 1.25, 2.5, 5.0, 2.6, -0.8, 0.74] + [0.0] * 24).reshape(1, 32)
    decoded = dequantize_mxfp4(*quantize_mxfp4(row), dtype=torch.float32)
    assert decoded[0, :8].tolist() == [6.0, 0.0, 1.0, 2.0, 4.0, 3.0, -1.0, 0.5]


def test_round_trip_error_is_within_half_the_widest_fp4_gap_and_requantizing_is_lossless():
    torch.manual_seed(0)
    w = torch.randn(3, 40, 128) * 0.02
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 40, 4, 16) and scales.shape == (3, 40, 4)
    decoded = dequantize_mxfp4(blocks, scales, torch.float32)
    # the widest FP4 gap (4 -> 6) is 2 * 2**e, so rounding to nearest errs by at most 2**e
    step = torch.ldexp(torch.ones(scales.shape), scales.int() - 127).repeat_interleave(32, dim=-1)
    assert ((decoded - w).abs() <= step + 1e-12).all()
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(decoded), dtype=torch.float32), decoded)


def test_layout_matches_transformers_dequantizer():
    torch.manual_seed(1)
    param = (torch.randn(4, 64, 96) * 0.05).to(torch.bfloat16)  # transformers' [experts, in, out]
    blocks, scales = expert_param_to_mxfp4(param)
    assert blocks.shape == (4, 96, 2, 16) and scales.shape == (4, 96, 2)  # checkpoint's [experts, out, in/32, 16]
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert reference.shape == param.shape
    assert torch.equal(mxfp4_to_expert_param(blocks, scales), reference)
    assert torch.equal(fake_quantize_expert_param(param), reference)


def test_rejects_bad_shapes_and_values():
    with pytest.raises(ValueError, match="multiple of the MXFP4 block size"):
        quantize_mxfp4(torch.zeros(2, 33))
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_mxfp4(torch.full((1, 32), float("nan")))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(torch.zeros(2, 2, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))


# (weight [E, out, in], tile (out, in))
TILE_ORDER_CASES = [
    ((2, 96, 160), (64, 64)),  # partial tiles down and along: padded both ways
    ((1, 128, 256), (128, 128)),  # whole tiles
    ((3, 40, 32), (128, 128)),  # smaller than one tile (the tiny model's experts are)
]


@pytest.mark.parametrize("shape, tile", TILE_ORDER_CASES)
def test_tile_order_round_trips_and_pads_with_zeros(shape, tile):
    experts, rows, cols = shape
    w = torch.randn(experts, rows, cols)
    blocks, scales = quantize_mxfp4(w)
    tiled = {"blocks": to_tile_order(blocks, "blocks", tile), "scales": to_tile_order(scales, "scales", tile)}
    for part, original in (("blocks", blocks), ("scales", scales)):
        assert tuple(tiled[part].shape) == tile_order_shape(part, experts, rows, cols, tile)
        assert torch.equal(from_tile_order(tiled[part], part, rows, cols), original)
        assert tiled[part].is_contiguous()
    assert sum(t.nbytes for t in tiled.values()) == experts * padded_bytes(rows, cols, tile)
    # tile (i, j) holds rows i*tile_rows.. and columns j*tile_cols..: its first row starts with the weight's bytes
    assert torch.equal(tiled["blocks"][0, 0, 0, 0, :min(cols, tile[1]) // 2],
                       blocks[0, 0].reshape(-1)[:min(cols, tile[1]) // 2])
    # the padding dequantizes to 0 (code 0 at scale 2**0)
    padded = dequantize_mxfp4(from_tile_order(tiled["blocks"], "blocks", *[-(-n // t) * t for n, t in
                                                                          zip((rows, cols), tile, strict=True)]),
                              from_tile_order(tiled["scales"], "scales", *[-(-n // t) * t for n, t in
                                                                          zip((rows, cols), tile, strict=True)]))
    assert torch.equal(padded[:, :rows, :cols], dequantize_mxfp4(blocks, scales))
    assert not padded[:, rows:].any() and not padded[:, :, cols:].any()


def test_tile_order_works_on_meta_tensors_and_refuses_bad_tiles():
    blocks = torch.empty(2, 96, 5, 16, dtype=torch.uint8, device="meta")
    assert to_tile_order(blocks, "blocks", (64, 64)).shape == (2, 2, 3, 64, 32)
    with pytest.raises(ValueError, match="part 'values'"):
        to_tile_order(blocks, "values")
    with pytest.raises(ValueError, match="multiple of 32"):
        to_tile_order(blocks, "blocks", (64, 48))
    with pytest.raises(ValueError, match="not the checkpoint's"):
        to_tile_order(blocks[..., 0], "blocks")  # scales-shaped blocks
    tiled = to_tile_order(torch.zeros(2, 96, 5, 16, dtype=torch.uint8), "blocks", (64, 64))
    for rows, cols, words in ((96, 150, "multiple of 32"), (129, 160, "at most [128, 192]"),
                              (96, 224, "at most [128, 192]")):
        with pytest.raises(ValueError, match=re.escape(words)):
            from_tile_order(tiled, "blocks", rows, cols)
    with pytest.raises(ValueError, match="not in tile order"):
        from_tile_order(blocks, "blocks", 96, 160)


HOPPER_CASES = [  # (experts, rows, cols) of a weight, padded to mxfp4.TILE
    (2, 96, 160),  # partial tiles both ways
    (1, 256, 512),  # whole tiles
    (3, 40, 32),  # smaller than one tile (the tiny model's experts are)
]


@pytest.mark.parametrize("shape", HOPPER_CASES)
def test_hopper_layout_round_trips_and_pads_with_zeros(shape):
    experts, rows, cols = shape
    blocks, scales = quantize_mxfp4(torch.randn(experts, rows, cols))
    stored = {"blocks": to_hopper_layout(blocks, "blocks"), "scales": to_hopper_layout(scales, "scales")}
    for part, original in (("blocks", blocks), ("scales", scales)):
        assert tuple(stored[part].shape) == hopper_shape(part, experts, rows, cols)
        assert torch.equal(from_hopper_layout(stored[part], part, rows, cols), original)
    assert sum(t.nbytes for t in stored.values()) == experts * padded_bytes(rows, cols)
    padded = [-(-n // 128) * 128 for n in (rows, cols)]
    whole = dequantize_mxfp4(from_hopper_layout(stored["blocks"], "blocks", *padded),
                             from_hopper_layout(stored["scales"], "scales", *padded))
    assert torch.equal(whole[:, :rows, :cols], dequantize_mxfp4(blocks, scales))
    assert not whole[:, rows:].any() and not whole[:, :, cols:].any()  # the padding holds the value 0


# (the 4 bytes of a word, the word _hopper_bits makes of them): each code's sign and 3 magnitude bits where
# mxfp4_kernels._hopper_halves' masks find them (low nibble in the low half)
HOPPER_BITS_CASES = [
    ((0x21, 0, 0, 0), 0x00800040),  # first byte: magnitude at bits 8..6 of each half (codes 1, 2)
    ((0, 0x21, 0, 0), 0x00100008),  # second byte: the first byte's places shifted right by 3
    ((0, 0, 0x21, 0), 0x00020001),  # third byte: shifted right by 6
    ((0, 0, 0, 0x21), 0x04002000),  # fourth byte: bit 0 at 13, bits 2 and 1 at 11 and 10
    ((0x88, 0x08, 0x08, 0x08), 0x8000D200),  # the signs: 15 (and 31), 12, 9, 14
]


@pytest.mark.parametrize("word_bytes, word", HOPPER_BITS_CASES)
def test_hopper_bits_place_each_code(word_bytes, word):
    from tes_grpo.experts.mxfp4 import _hopper_bits, _hopper_unbits

    data = torch.tensor([word_bytes], dtype=torch.uint8)
    placed = _hopper_bits(data)
    assert int(placed.view(torch.int32)[0, 0]) & 0xFFFFFFFF == word
    assert torch.equal(_hopper_unbits(placed), data)


def test_hopper_bits_round_trip_every_byte_in_every_place():
    from tes_grpo.experts.mxfp4 import _hopper_bits, _hopper_unbits

    every = torch.arange(256, dtype=torch.uint8)
    data = torch.stack([every, every.roll(1), every.roll(2), every.roll(3)], dim=-1)
    assert torch.equal(_hopper_unbits(_hopper_bits(data)), data)


def test_hopper_layout_works_on_meta_tensors_and_refuses_bad_shapes():
    blocks = torch.empty(2, 96, 5, 16, dtype=torch.uint8, device="meta")
    assert to_hopper_layout(blocks, "blocks").shape == (2, 32, 512)
    with pytest.raises(ValueError, match=re.escape("rows a multiple of 32 x 4 warps")):
        to_hopper_layout(blocks, "blocks", (64, 128))
    with pytest.raises(ValueError, match="not the checkpoint's"):
        to_hopper_layout(blocks[..., 0], "blocks")  # scales-shaped blocks
    stored = to_hopper_layout(torch.zeros(2, 96, 5, 16, dtype=torch.uint8), "blocks")
    for rows, cols in ((96, 150), (129, 160), (96, 288)):
        with pytest.raises(ValueError, match="is not what blocks of shape"):
            from_hopper_layout(stored, "blocks", rows, cols)
    with pytest.raises(ValueError, match="not in the Hopper layout"):
        from_hopper_layout(blocks, "blocks", 96, 160)


def test_checkpoint_layout_and_config(tmp_path):
    model = tiny_model()
    stats = write_mxfp4_checkpoint(model, model.config, tmp_path)
    assert stats["quantized"] == 4 and stats["copied"] == 0
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        blocks = handle.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks")
        scales = handle.get_tensor("model.layers.1.mlp.experts.down_proj_scales")
        bias = handle.get_tensor("model.layers.0.mlp.experts.gate_up_proj_bias")
        router = handle.get_tensor("model.layers.0.mlp.router.weight")
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    assert blocks.dtype == torch.uint8 and blocks.shape == (4, 128, 2, 16)  # [E, 2I, H/32, 16]
    assert scales.dtype == torch.uint8 and scales.shape == (4, 64, 2)  # down: [E, H, I/32]
    assert bias.dtype == torch.bfloat16 and router.dtype == torch.bfloat16
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}


@pytest.mark.slow
def test_loads_with_dequantize_to_exactly_our_dequantized_weights(tmp_path):
    model = tiny_model()
    write_mxfp4_checkpoint(model, model.config, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.bfloat16)
    original = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        expected = original[name]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            expected = fake_quantize_expert_param(expected)
            assert not torch.equal(expected, original[name])  # quantization really changed them
        assert torch.equal(tensor, expected), name


def test_passthrough_copies_blocks_bit_for_bit_and_shards(tmp_path):
    model = tiny_model()
    base_dir, copy_dir = tmp_path / "base", tmp_path / "copy"
    write_mxfp4_checkpoint(model, model.config, base_dir)
    base = SafetensorsCheckpoint(base_dir)
    # flip the code of one value in the base: a re-quantization would not reproduce this byte, a copy does
    name = "model.layers.1.mlp.experts.down_proj_blocks"
    edited = {key: base[key] for key in base if key.endswith(("_blocks", "_scales"))}
    edited[name] = edited[name].clone()
    edited[name][0, 0, 0, 0] ^= 0x08
    stats = write_mxfp4_checkpoint(model, model.config, copy_dir, passthrough=edited, max_shard_bytes=200_000)
    assert stats["copied"] == 4 and stats["quantized"] == 0
    assert (copy_dir / "model.safetensors.index.json").is_file() and len(stats["files"]) > 1
    copy = SafetensorsCheckpoint(copy_dir)
    assert set(copy) == set(base)
    for key in edited:
        assert torch.equal(copy[key], edited[key]), key
    with pytest.raises(ValueError, match="do not fit"):
        bad = dict(edited, **{name: edited[name][:, :32]})
        write_mxfp4_checkpoint(model, model.config, tmp_path / "bad", passthrough=bad)


def gpt_oss_20b():
    from tes_grpo.model.gpt_oss_shapes import gpt_oss_20b_config

    return gpt_oss_20b_config()


YARN_20B = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096}  # openai/gpt-oss-20b config.json's rope_scaling

# (config, the keys legacy_config_keys adds: openai/gpt-oss-20b's spelling, or the error it raises)
LEGACY_KEYS = [
    # transformers 5's to_dict of the 20B config: RoPE only in rope_parameters, no experts_per_token
    (lambda: gpt_oss_20b().to_dict(),
     {"architectures": ["GptOssForCausalLM"], "rope_theta": 150000.0, "rope_scaling": YARN_20B,
      "experts_per_token": 4, "initial_context_length": 4096}),
    # the tiny test config: GptOssConfig's default RoPE is the 20B's; 2 experts per token
    (lambda: tiny_config().to_dict(),
     {"architectures": ["GptOssForCausalLM"], "rope_theta": 150000.0, "rope_scaling": YARN_20B,
      "experts_per_token": 2, "initial_context_length": 4096}),
    # an older transformers' dict already has the legacy keys: kept; architectures kept too
    (lambda: {"architectures": ["X"], "rope_theta": 10000.0, "rope_scaling": None, "num_experts_per_tok": 2},
     {"architectures": ["X"], "rope_theta": 10000.0, "experts_per_token": 2}),
    # no theta anywhere: refused rather than written as Ollama's silent zero
    (lambda: {"num_experts_per_tok": 2}, ValueError),
]


@pytest.mark.parametrize("make_config, expected", LEGACY_KEYS)
def test_legacy_config_keys(make_config, expected):
    if expected is ValueError:
        with pytest.raises(ValueError, match="no RoPE theta"):
            legacy_config_keys(make_config())
    else:
        assert legacy_config_keys(make_config()) == expected


@pytest.mark.parametrize("make_config", [gpt_oss_20b, tiny_config])
def test_written_config_reads_back_into_the_same_config(tmp_path, make_config):
    from transformers import AutoConfig

    config = make_config()
    write_config_json(config, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written and "rope_scaling" in written and "rope_theta" in written  # both spellings
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.rope_parameters == config.rope_parameters  # transformers 5 reads the two spellings as one
    assert loaded.num_experts_per_tok == config.num_experts_per_tok


@pytest.mark.slow
def test_tokenizer_files_carry_the_chat_template_in_tokenizer_config(tmp_path):
    from transformers import AutoTokenizer

    from tes_grpo.task.harmony import load_tokenizer

    tokenizer = load_tokenizer()
    save_tokenizer_files(tokenizer, tmp_path)
    in_config = json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]
    assert in_config == (tmp_path / "chat_template.jinja").read_text() == tokenizer.chat_template
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template == tokenizer.chat_template
