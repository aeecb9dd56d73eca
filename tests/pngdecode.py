"""A small PNG decoder for tests that look at screenshots: stdlib zlib and struct only.

Reads what browsers write: 8-bit RGB or RGBA, not interlaced, every chunk's CRC checked. Pixels
come back as RGB tuples, row by row (alpha dropped: screenshots of pages are opaque).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: colour type -> bytes per pixel at bit depth 8
CHANNELS_BY_COLOUR_TYPE = {2: 3, 6: 4}


class PngError(ValueError):
    """The bytes are not a PNG this decoder reads."""


@dataclass(frozen=True)
class Image:
    width: int
    height: int
    pixels: tuple[tuple[int, int, int], ...]  # row-major RGB

    def pixel(self, x: int, y: int) -> tuple[int, int, int]:
        return self.pixels[y * self.width + x]


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, payload) of every chunk, CRCs checked, up to and including IEND."""
    if not data.startswith(SIGNATURE):
        raise PngError("no PNG signature")
    found = []
    offset = len(SIGNATURE)
    while True:
        if offset + 8 > len(data):
            raise PngError("truncated before IEND")
        length, kind = struct.unpack(">I4s", data[offset:offset + 8])
        payload = data[offset + 8:offset + 8 + length]
        crc_bytes = data[offset + 8 + length:offset + 12 + length]
        if len(payload) != length or len(crc_bytes) != 4:
            raise PngError(f"truncated {kind!r} chunk")
        if zlib.crc32(kind + payload) != struct.unpack(">I", crc_bytes)[0]:
            raise PngError(f"bad CRC in {kind!r} chunk")
        found.append((kind, payload))
        offset += 12 + length
        if kind == b"IEND":
            return found


def paeth(left: int, up: int, up_left: int) -> int:
    estimate = left + up - up_left
    distances = (abs(estimate - left), abs(estimate - up), abs(estimate - up_left))
    return (left, up, up_left)[distances.index(min(distances))]


def unfilter(raw: bytes, width: int, height: int, channels: int) -> list[bytes]:
    """Undo the per-row filters (types 0-4 of the PNG specification)."""
    stride = width * channels
    if len(raw) != height * (stride + 1):
        raise PngError(f"image data is {len(raw)} bytes, expected {height * (stride + 1)}")
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        if kind == 1:
            for i in range(channels, stride):
                line[i] = (line[i] + line[i - channels]) & 0xFF
        elif kind == 2:
            for i in range(stride):
                line[i] = (line[i] + previous[i]) & 0xFF
        elif kind == 3:
            for i in range(stride):
                left = line[i - channels] if i >= channels else 0
                line[i] = (line[i] + (left + previous[i]) // 2) & 0xFF
        elif kind == 4:
            for i in range(stride):
                left = line[i - channels] if i >= channels else 0
                up_left = previous[i - channels] if i >= channels else 0
                line[i] = (line[i] + paeth(left, previous[i], up_left)) & 0xFF
        elif kind != 0:
            raise PngError(f"row {y}: unknown filter type {kind}")
        rows.append(bytes(line))
        previous = line
    return rows


def decode_png(data: bytes) -> Image:
    found = chunks(data)
    if found[0][0] != b"IHDR":
        raise PngError("the first chunk is not IHDR")
    width, height, depth, colour_type, compression, filtering, interlace = struct.unpack(
        ">IIBBBBB", found[0][1])
    if depth != 8 or colour_type not in CHANNELS_BY_COLOUR_TYPE:
        raise PngError(f"unsupported bit depth {depth} / colour type {colour_type}")
    if (compression, filtering, interlace) != (0, 0, 0):
        raise PngError("unsupported compression, filter method or interlacing")
    channels = CHANNELS_BY_COLOUR_TYPE[colour_type]
    raw = zlib.decompress(b"".join(payload for kind, payload in found if kind == b"IDAT"))
    pixels = tuple(tuple(row[x:x + 3]) for row in unfilter(raw, width, height, channels)
                   for x in range(0, width * channels, channels))
    return Image(width, height, pixels)  # type: ignore[arg-type]
