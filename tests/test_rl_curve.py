"""benchmarks/rl_curve.py (the rl-curve case) without training: the PNG writer's file read back by
this file's own PNG reader (chunk CRCs, the scanlines inflated), the curve's reading and smoothing,
the trainer command it builds, and the refusals (no weights for the GPU run, in the script and in
`python -m benchmarks rl-curve`). The --tiny run itself is `python -m benchmarks rl-curve --smoke`
(about 45 s on two CPU cores: compiles), not a test."""
import json
import os
import pathlib
import struct
import subprocess
import sys
import zlib

import pytest

from benchmarks import png_plot, rl_curve

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _read_png(path):
    """(width, height, RGB rows) of an 8-bit RGB, unfiltered PNG; every chunk's CRC checked."""
    data = pathlib.Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    i, chunks = 8, {}
    while i < len(data):
        (n,) = struct.unpack(">I", data[i:i + 4])
        kind, body = data[i + 4:i + 8], data[i + 8:i + 8 + n]
        assert struct.unpack(">I", data[i + 8 + n:i + 12 + n])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        i += 12 + n
    w, h, depth, color, *_ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == h * (1 + 3 * w)
    rows = [raw[y * (1 + 3 * w):(y + 1) * (1 + 3 * w)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return w, h, [r[1:] for r in rows]


def test_png_writer_draws_each_series_in_its_color(tmp_path):
    path = tmp_path / "p.png"
    xs = list(range(1, 51))
    png_plot.write_line_plot(str(path), xs, [[x / 50 for x in xs], [0.5] * 50], y_range=(0.0, 1.0))
    w, h, rows = _read_png(path)
    assert (w, h) == (png_plot.WIDTH, png_plot.HEIGHT)
    pixels = {bytes(r[3 * x:3 * x + 3]) for r in rows for x in range(w)}
    assert {bytes(png_plot.COLORS[0]), bytes(png_plot.COLORS[1]), bytes(png_plot.AXIS)} <= pixels
    # the flat series at 0.5 is one horizontal line of the dark color, half way between the axis ends
    dark = [y for y, r in enumerate(rows) if r.count(bytes(png_plot.COLORS[1])) > w // 2]
    assert len(dark) == 1 and abs(dark[0] - (10 + h - png_plot.MARGIN // 2) / 2) <= 1


def test_curve_read_and_smoothed(tmp_path):
    path = tmp_path / "Train_Samples_reward_mean.csv"
    path.write_text("step,mean\n128,0.25\n256,0.5\n384,1.0\n")
    assert rl_curve.read_curve(str(path)) == [(1, 0.25), (2, 0.5), (3, 1.0)]
    assert rl_curve.moving_average([0.0, 1.0, 2.0, 3.0], k=2) == [0.0, 0.5, 1.5, 2.5]


def test_train_command_is_whole_groups_with_the_monitors_on(tmp_path):
    args = rl_curve.parse_args(["--hf-checkpoint", str(tmp_path), "--out", str(tmp_path)])
    config = rl_curve.write_config(str(tmp_path))
    cmd = rl_curve.train_command(args, config, seq_len=350)
    flag = {a: cmd[i + 1] for i, a in enumerate(cmd) if a.startswith("--") and a != "--method-option"}
    micro, accum = int(flag["--micro-batch"]), int(flag["--grad-accum"])
    assert micro * accum == args.prompts * args.group == 128 and micro % args.group == 0
    assert (flag["--data"], flag["--steps"], flag["--seq-len"]) == ("word-problems", "200", "350")
    options = dict(cmd[i + 1].split("=", 1) for i, a in enumerate(cmd) if a == "--method-option")
    assert json.loads(options["stop"]) == ["\nQ:"] and json.loads(options["max_new_tokens"]) == 256
    cfg = json.loads(pathlib.Path(config).read_text())
    assert cfg["csv_monitor"] == {"enabled": True, "output_path": str(tmp_path / "logs"), "job_name": "rl-curve"}
    assert cfg["tensorboard"]["enabled"]


@pytest.mark.parametrize("argv", [[], ["--tiny", "--hf-checkpoint", "x"]])
def test_script_wants_weights_or_tiny(argv, capsys):
    with pytest.raises(SystemExit):
        rl_curve.parse_args(argv)
    assert "give --hf-checkpoint DIR" in capsys.readouterr().err


def test_suite_refuses_the_case_without_weights(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks", "rl-curve", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode != 0
    assert "case rl-curve: needs --hf-checkpoint DIR" in done.stderr
    assert not list(tmp_path.iterdir())  # refused before any run started
