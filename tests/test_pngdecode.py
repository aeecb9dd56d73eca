"""The screenshot tests' PNG decoder, against PNGs encoded here with every row filter."""

from __future__ import annotations

import struct
import zlib

import pytest

from pngdecode import PngError, decode_png


def predictor(left: int, up: int, up_left: int) -> int:
    """The Paeth predictor as the PNG specification writes it."""
    p = left + up - up_left
    pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
    if pa <= pb and pa <= pc:
        return left
    if pb <= pc:
        return up
    return up_left


def filtered(row: bytes, previous: bytes, kind: int, channels: int) -> bytes:
    out = bytearray([kind])
    for i, value in enumerate(row):
        left = row[i - channels] if i >= channels else 0
        up = previous[i]
        up_left = previous[i - channels] if i >= channels else 0
        prediction = (0, left, up, (left + up) // 2, predictor(left, up, up_left))[kind]
        out.append((value - prediction) & 0xFF)
    return bytes(out)


def chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(
        ">I", zlib.crc32(kind + payload))


def encode(width: int, height: int, channels: int, samples: bytes) -> bytes:
    """A PNG whose rows use filters 0, 1, 2, 3, 4, 0, ... in turn, split over two IDATs."""
    stride = width * channels
    rows = [samples[y * stride:(y + 1) * stride] for y in range(height)]
    raw = b"".join(filtered(row, rows[y - 1] if y else bytes(stride), y % 5, channels)
                   for y, row in enumerate(rows))
    data = zlib.compress(raw)
    header = struct.pack(">IIBBBBB", width, height, 8, {3: 2, 4: 6}[channels], 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data[:7])
            + chunk(b"IDAT", data[7:]) + chunk(b"IEND", b""))


@pytest.mark.parametrize("channels", [3, 4])
def test_every_filter_decodes_to_the_encoded_pixels(channels: int) -> None:
    width, height = 7, 11
    samples = bytes((x * 37 + y * 101 + c * 59 + x * y * 13) % 256
                    for y in range(height) for x in range(width) for c in range(channels))
    image = decode_png(encode(width, height, channels, samples))
    assert (image.width, image.height) == (width, height)
    for y in range(height):
        for x in range(width):
            start = (y * width + x) * channels
            assert image.pixel(x, y) == tuple(samples[start:start + 3]), (x, y)


def test_what_it_cannot_read_is_an_error() -> None:
    good = encode(2, 2, 3, bytes(range(12)))
    with pytest.raises(PngError, match="signature"):
        decode_png(b"GIF89a" + good[6:])
    corrupt = bytearray(good)
    corrupt[20] ^= 1  # inside IHDR
    with pytest.raises(PngError, match="CRC"):
        decode_png(bytes(corrupt))
    with pytest.raises(PngError, match="truncated"):
        decode_png(good[:-12])  # no IEND
    palette = good.replace(chunk(b"IHDR", good[16:29]),
                           chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 3, 0, 0, 0)))
    with pytest.raises(PngError, match="colour type 3"):
        decode_png(palette)
