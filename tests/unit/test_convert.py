"""Image conversion rules, against hand-computed pixels."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from ganpipe.data.convert import BadImageError, convert_image, decode, is_image_name


def test_extensions_are_case_insensitive():
    assert is_image_name("a.PNG") and is_image_name("b.JpEg") and is_image_name("c.tiff")
    assert not is_image_name("notes.txt") and not is_image_name("png")


def test_same_size_is_untouched():
    pixels = np.arange(64, dtype=np.uint8).reshape(8, 8)
    out = convert_image(Image.fromarray(pixels), 8, 1)
    assert out.shape == (8, 8, 1)
    np.testing.assert_array_equal(out[..., 0], pixels)


def test_short_side_resize_then_center_crop():
    # 16x8: left quarter black, middle half grey, right quarter white -> 8x8 keeps the grey.
    pixels = np.zeros((8, 16), dtype=np.uint8)
    pixels[:, 4:12] = 128
    pixels[:, 12:] = 255
    out = convert_image(Image.fromarray(pixels), 8, 1)[..., 0]
    np.testing.assert_array_equal(out, np.full((8, 8), 128, dtype=np.uint8))


def test_rgba_is_composited_on_black():
    out = convert_image(Image.new("RGBA", (4, 4), (200, 100, 50, 128)), 4, 3)
    expected = np.rint(np.array([200, 100, 50]) * 128 / 255)
    np.testing.assert_allclose(out[0, 0], expected, atol=1)
    assert out.shape == (4, 4, 3)


def test_la_becomes_grey_on_black():
    out = convert_image(Image.new("LA", (4, 4), (255, 64)), 4, 1)
    assert abs(int(out[0, 0, 0]) - 64) <= 1


def test_palette_with_transparency_uses_alpha():
    image = Image.new("P", (4, 4), 1)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.info["transparency"] = 1
    out = convert_image(image, 4, 3)
    np.testing.assert_array_equal(out[0, 0], [0, 0, 0])  # fully transparent red -> black


def test_sixteen_bit_is_scaled():
    wide = np.array([[0, 257 * 100], [65535, 257 * 200]], dtype=np.uint16)
    image = Image.fromarray(wide)
    assert image.mode.startswith("I;16")
    out = convert_image(image, 2, 1)[..., 0]
    np.testing.assert_array_equal(out, [[0, 100], [255, 200]])


def test_grey_to_rgb_and_rgb_to_luma():
    grey = convert_image(Image.new("L", (2, 2), 77), 2, 3)
    np.testing.assert_array_equal(grey[0, 0], [77, 77, 77])
    luma = convert_image(Image.new("RGB", (2, 2), (255, 0, 0)), 2, 1)
    assert luma[0, 0, 0] == 76  # ITU-R 601-2: 0.299 * 255


def test_tiny_image_is_upscaled():
    out = convert_image(Image.new("L", (1, 1), 9), 16, 1)
    assert out.shape == (16, 16, 1) and (out == 9).all()


def test_decode_names_the_file_on_failure(tmp_path):
    path = tmp_path / "broken.png"
    path.write_bytes(b"not an image at all")
    with pytest.raises(BadImageError) as info:
        decode(("sub/broken.png", path), 8, 1)
    assert info.value.name == "sub/broken.png"
    assert "cannot identify image file" in info.value.reason
