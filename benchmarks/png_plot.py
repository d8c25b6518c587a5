"""A line plot written as a PNG with the standard library alone (zlib, struct), for benchmark
programs where matplotlib is not installed (the project does not depend on it): white canvas,
gridlines at the quarters of the y range with their values in a 3 x 5 pixel digit font, the last
x value under the right end of the axis, one line per series (the first light, the others dark).
No text labels: the program that writes the plot says what it shows.
"""
from __future__ import annotations

import struct
import zlib

WIDTH, HEIGHT, MARGIN = 640, 360, 40
COLORS = ((158, 202, 225), (8, 81, 156), (203, 24, 29))
GRID, AXIS = (225, 225, 225), (0, 0, 0)
# 3 x 5 glyphs, a row of 3 bits a digit line (top first)
FONT = {"0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
        "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
        "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0)}


class Canvas:
    """RGB pixels, (0, 0) at the top left."""

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        """Bresenham's line, both ends drawn."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.dot(x0, y0, color)
            if (x0, y0) == (x1, y1):
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, color=AXIS, scale: int = 2) -> None:
        """s in the digit font, its top left at (x, y); characters outside it are skipped."""
        for k, ch in enumerate(s):
            for row, bits in enumerate(FONT.get(ch, (0,) * 5)):
                for col in range(3):
                    if bits >> (2 - col) & 1:
                        for a in range(scale):
                            for b in range(scale):
                                self.dot(x + k * 4 * scale + col * scale + a, y + row * scale + b, color)

    def png(self) -> bytes:
        """The canvas as a PNG file: 8-bit RGB, each scanline unfiltered (filter byte 0)."""
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride]) for y in range(self.height))
        ihdr = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 9)) + \
            _chunk(b"IEND", b"")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _scale(lo: float, hi: float, a: int, b: int):
    """value in [lo, hi] -> pixel in [a, b] (a flat range maps to the middle)."""
    span = hi - lo
    return (lambda v: round(a + (v - lo) / span * (b - a))) if span else (lambda v: (a + b) // 2)


def write_line_plot(path: str, xs: list, series: list[list[float]], y_range: tuple[float, float] | None = None):
    """series (each as long as xs) against xs, written to path as a PNG."""
    values = [v for s in series for v in s]
    lo, hi = y_range or (min(values, default=0.0), max(values, default=1.0))
    c = Canvas(WIDTH, HEIGHT)
    left, right, top, bottom = MARGIN, WIDTH - 10, 10, HEIGHT - MARGIN // 2
    to_x = _scale(min(xs, default=0), max(xs, default=1), left, right)
    to_y = _scale(lo, hi, bottom, top)
    for q in range(5):  # gridlines and their values at the quarters of the range
        v = lo + (hi - lo) * q / 4
        c.line(left, to_y(v), right, to_y(v), GRID)
        c.text(2, to_y(v) - 5, f"{v:.2f}".rstrip("0").rstrip(".") or "0")
    c.line(left, top, left, bottom, AXIS)
    c.line(left, bottom, right, bottom, AXIS)
    if xs:
        c.text(right - 4 * 2 * len(str(xs[-1])), bottom + 4, str(xs[-1]))
    for k, ys in enumerate(series):
        points = [(to_x(x), to_y(y)) for x, y in zip(xs, ys)]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            c.line(x0, y0, x1, y1, COLORS[min(k, len(COLORS) - 1)])
        if len(points) == 1:
            c.dot(*points[0], COLORS[min(k, len(COLORS) - 1)])
    with open(path, "wb") as f:
        f.write(c.png())
