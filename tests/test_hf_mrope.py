"""rope_ext.hf.enable() on the vision-language models with multi-axis RoPE: Qwen2-VL,
Qwen2.5-VL and Qwen3-VL (tiny configs, random weights). Text-only and text + image inputs give
the stock model's logits and greedy generations; the text rotary module no longer builds
cos/sin per token, and disable() restores everything."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    # 4.x's VL models rotate with apply_multimodal_rotary_pos_emb and the sections from the
    # attention's config; enable() leaves their text side alone (tests/test_hf.py covers it).
    pytest.skip("MRoPE in rope_ext.hf follows transformers 5's VL models",
                allow_module_level=True)

import rope_ext  # noqa: E402
import rope_ext.hf  # noqa: E402

pytestmark = pytest.mark.integration

IMAGE, VIDEO, START, END = 5, 6, 3, 4
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def tiny_model(model_type, dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForImageTextToText

    section = [6, 5, 5] if model_type == "qwen3_vl" else [4, 6, 6]  # head_dim 32
    text = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                num_hidden_layers=2, intermediate_size=128, vocab_size=100,
                max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": section})
    vision = dict(depth=2, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    if model_type == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    elif model_type == "qwen2_5_vl":
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=64, window_size=16,
                      fullatt_block_indexes=[1])
    else:
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=64,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision,
                                  image_token_id=IMAGE, video_token_id=VIDEO,
                                  vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config).to(dtype).eval()


def inputs(with_image: bool, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    if not with_image:
        return dict(input_ids=torch.randint(10, 100, (2, 9), generator=gen))
    h, w = 4, 6  # patches; 6 image tokens after the 2 x 2 merge
    ids = torch.tensor([[10, 11, START] + [IMAGE] * (h * w // 4) + [END, 12, 13, 14]])
    return dict(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(),
                pixel_values=torch.randn(h * w, 3 * 2 * 4 * 4, generator=gen).to(dtype),
                image_grid_thw=torch.tensor([[1, h, w]]))


@pytest.fixture
def patched():
    yield
    rope_ext.hf.disable()


def run(model, kwargs):
    with torch.no_grad():
        logits = model(**kwargs).logits
        tokens = model.generate(**kwargs, max_new_tokens=20, do_sample=False)
    return logits, tokens


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "text+image"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_generation_match(family, with_image, patched):
    model = tiny_model(family)
    kwargs = inputs(with_image)
    want_logits, want_tokens = run(model, kwargs)
    rope_ext.hf.enable()
    rotary = model.model.language_model.rotary_emb
    table, positions = rotary(torch.zeros(1), torch.zeros(3, 1, 4, dtype=torch.long))
    assert isinstance(positions, rope_ext.hf.MropePositions), "cos/sin still built per token"
    assert table.shape[1:] == (16, 2)
    got_logits, got_tokens = run(model, kwargs)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-5, rtol=2e-5)
    assert torch.equal(got_tokens, want_tokens)
    rope_ext.hf.disable()
    again_logits, _ = run(model, kwargs)
    assert torch.equal(again_logits, want_logits)  # transformers' own path restored


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_logits_within_rounding(family, patched):
    model = tiny_model(family, torch.bfloat16)
    kwargs = inputs(True, torch.bfloat16)
    want, _ = run(model, kwargs)
    rope_ext.hf.enable()
    got, _ = run(model, kwargs)
    # transformers rounds cos/sin to bfloat16 and rotates in bfloat16; rope_ext rotates in
    # float32 from a float32 table and rounds once.
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)


def test_enable_patches_the_vlm_functions_and_disable_restores(patched):
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m

    forward, apply, vision = (m.Qwen2VLRotaryEmbedding.forward, m.apply_rotary_pos_emb,
                              m.apply_rotary_pos_emb_vision)
    modules = rope_ext.hf.enable()
    assert m.__name__ in modules
    assert m.apply_rotary_pos_emb.rope_ext_variant == "half-split"
    assert m.apply_rotary_pos_emb_vision.rope_ext_variant.startswith("half-split, float32")
    assert m.Qwen2VLRotaryEmbedding.forward.rope_ext_original is forward
    rope_ext.hf.disable()
    assert (m.Qwen2VLRotaryEmbedding.forward, m.apply_rotary_pos_emb,
            m.apply_rotary_pos_emb_vision) == (forward, apply, vision)


def test_vision_function_matches():
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m

    rope_ext.hf.enable()
    try:
        dropin = m.apply_rotary_pos_emb_vision
    finally:
        rope_ext.hf.disable()
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(30, 2, 32, generator=gen).bfloat16()
    k = torch.randn(30, 2, 32, generator=gen).bfloat16()
    angles = torch.rand(30, 16, generator=gen) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    for got, want in zip(dropin(q, k, cos, sin), m.apply_rotary_pos_emb_vision(q, k, cos, sin)):
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=8e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_mrope_positions_match_get_rope_index(family):
    """rope_ext.mrope_positions against the model's own get_rope_index: two sequences, text,
    images of two grid shapes, and (Qwen2-VL) a video."""
    model = tiny_model(family)
    types = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0],
                          [0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    grids = torch.tensor([[1, 4, 6], [1, 2, 4], [1, 6, 4]])
    kwargs = dict(image_grid_thw=grids)
    if family == "qwen2_vl":  # the second sequence's last 4 tokens: a 2-frame video
        types[1, -4:] = 2
        kwargs["video_grid_thw"] = torch.tensor([[2, 2, 4]])
    ids = torch.where(types == 0, 10, torch.where(types == 1, IMAGE, VIDEO))
    want, want_deltas = model.model.get_rope_index(ids, types, **kwargs)
    got, deltas = rope_ext.mrope_positions(types, **kwargs)
    assert torch.equal(got, want)
    assert torch.equal(deltas, want_deltas.view(-1))


def test_mrope_positions_rejects_a_block_that_does_not_fit_its_grid():
    types = torch.tensor([0, 1, 1, 1, 0])
    with pytest.raises(ValueError, match="a vision block of 3 tokens at token 1 does not match"):
        rope_ext.mrope_positions(types, torch.tensor([[1, 4, 4]]))
