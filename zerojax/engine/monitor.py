"""DeepSpeed's monitors (csv_monitor, tensorboard, wandb) for zerojax metrics.

DeepSpeed logs `Train/Samples/train_loss`, `Train/Samples/lr` and (fp16) `Train/Samples/loss_scale`
once per optimizer step, indexed by global samples. Reading a metric forces a device sync, so we
buffer the step's metrics as device arrays and write them on `flush()` (every `steps_per_print`
steps and at the end): the numbers are the same, the step is not slowed.

csv_monitor and tensorboard need nothing beyond zerojax's own dependencies: TensorBoard's event
files (TFRecord framing, `tensorflow.Event` protobufs with scalar summaries) are written here
directly, readable by `tensorboard --logdir`. wandb needs the `wandb` package (`pip install
zerojax[wandb]`). `monitor_problems(cfg)` says what would stop a monitor, before anything is built;
`Monitor` checks every section first and creates no folder when one cannot start.
Imports nothing of zerojax: sections are read by attribute (enabled, output_path, job_name, ...).
"""
from __future__ import annotations

import csv
import os
import socket
import struct
import time
from collections.abc import Iterable
from typing import Any

# metric key in the engine's metrics dict -> DeepSpeed event name
EVENT_NAMES = {
    "loss": "Train/Samples/train_loss",
    "lr": "Train/Samples/lr",
    "loss_scale": "Train/Samples/loss_scale",
}
METHOD_PREFIX = "Train/Samples/"  # a method's metric reward/mean -> Train/Samples/reward/mean


class MonitorError(RuntimeError):
    """An enabled monitor that cannot start; the message names the config section and the fix."""


def _log_dir(section, default_job: str) -> str:
    # DeepSpeed: output_path/job_name; its default output_path is "" (the working directory).
    return os.path.join(section.output_path or "", section.job_name or default_job)


def _dir_problem(key: str, section) -> str | None:
    """Whether output_path/job_name can be a folder (checked without creating anything)."""
    path = os.path.abspath(_log_dir(section, "DeepSpeedJobName"))
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return (f"{key}.output_path / job_name: {path!r} cannot be a folder ({probe!r} is a file); "
                f"set {key}.output_path to a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{key}.output_path / job_name: {probe!r} is not writable; set {key}.output_path to a writable folder"
    return None


def monitor_problems(cfg) -> list[str]:
    """One line per enabled monitor section that could not start (a missing package, an output
    folder that cannot be made), found without creating anything."""
    problems = []
    for key in ("csv_monitor", "tensorboard"):
        section = getattr(cfg, key, None)
        if section is not None and section.enabled:
            problem = _dir_problem(key, section)
            if problem:
                problems.append(problem)
    section = getattr(cfg, "wandb", None)
    if section is not None and section.enabled:
        try:
            import wandb  # noqa: F401 -- imported, not just found: a broken install fails here too
        except ImportError as e:
            problems.append(f"wandb.enabled is true but the wandb package cannot be imported ({e}): "
                            "`pip install zerojax[wandb]` (or `pip install wandb`), or set wandb.enabled to false")
    return problems


def check_monitors(cfg) -> None:
    """Raise MonitorError (one line per problem) if an enabled monitor could not start."""
    problems = monitor_problems(cfg)
    if problems:
        raise MonitorError("; ".join(problems))


class CSVMonitor:
    """One `<event name with / -> _>.csv` per event with a `step,<last part>` header, as DeepSpeed.
    The folder is made at the first write (a run that stops before it leaves none)."""

    def __init__(self, section):
        self.log_dir = _log_dir(section, "DeepSpeedJobName")

    def write_events(self, events: Iterable[tuple[str, float, int]]) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        for name, value, step in events:
            path = os.path.join(self.log_dir, name.replace("/", "_").replace(" ", "_") + ".csv")
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- TensorBoard event files

def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord frames use."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, its masked CRC."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf encodes it
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event_bytes(wall_time: float, step: int = 0, *, file_version: str | None = None,
                scalars: Iterable[tuple[str, float]] = ()) -> bytes:
    """A `tensorflow.Event` protobuf: wall_time (1, double), step (2, int64), file_version (3) or a
    summary (5) of `Summary.Value`s with tag (1) and simple_value (2, float)."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _field_bytes(3, file_version.encode())
    values = b"".join(_field_bytes(1, _field_bytes(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
                      for tag, value in scalars)
    if values:
        out += _field_bytes(5, values)
    return out


class TensorBoardMonitor:
    """TensorBoard event files in output_path/job_name (DeepSpeed's SummaryWriter log_dir), one
    scalar per event, written without TensorFlow / tensorboardX. The file is opened at the first
    write."""

    def __init__(self, section):
        self.log_dir = _log_dir(section, "DeepSpeedJobName")
        self._file = None

    def _open(self):
        os.makedirs(self.log_dir, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.zerojax"
        self._file = open(os.path.join(self.log_dir, name), "wb")
        self._file.write(tfrecord(event_bytes(now, file_version="brain.Event:2")))

    def write_events(self, events):
        if self._file is None:
            self._open()
        now = time.time()
        for name, value, step in events:
            self._file.write(tfrecord(event_bytes(now, step, scalars=[(name, value)])))
        self._file.flush()

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: str) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in an event file (the frames' CRCs checked): what
    TensorBoard would plot."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        header = data[i:i + 8]
        (length,), (crc,) = struct.unpack("<Q", header), struct.unpack("<I", data[i + 8:i + 12])
        if crc != _masked_crc(header):
            raise ValueError(f"{path}: bad length CRC at byte {i}")
        body = data[i + 12:i + 12 + length]
        if struct.unpack("<I", data[i + 12 + length:i + 16 + length])[0] != _masked_crc(body):
            raise ValueError(f"{path}: bad data CRC at byte {i}")
        i += 16 + length
        fields = dict(_fields(body))
        for _, value in _fields(fields.get(5, b"")):
            v = dict(_fields(value))
            out.append((fields.get(2, 0), v[1].decode(), struct.unpack("<f", v[2])[0]))
    return out


def _fields(buf: bytes):
    """(number, value) of a protobuf message's fields (varint -> int, fixed -> raw bytes)."""
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            value, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, value


def _read_varint(buf, i):
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


# --------------------------------------------------------------------------- training speed

_COMPILE_EVENT_PREFIX = "/jax/core/compile/"  # tracing, lowering and XLA's compile of any jit
_compiles = 0
_listening = False


def _on_duration_event(event, duration, **kwargs):
    global _compiles
    if event.startswith(_COMPILE_EVENT_PREFIX):
        _compiles += 1


def compile_count() -> int:
    """How many compilation events (trace, lower, compile) JAX has reported in this process since
    the first call (a listener is registered once, on that call)."""
    global _listening
    if not _listening:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_on_duration_event)
        _listening = True
    return _compiles


class SpeedMeter:
    """Training tokens/s per device, compilation excluded: the one definition every speed line and
    summary uses.

    Steps are timed in windows between host syncs. A step that compiled anything (JAX compiles on
    the calling thread, during the call) is waited for and its window dropped, so neither the
    first step's compile nor a later one (a resumed state, a new shape) counts. Around each step:
    `before_step()`, the step, `after_step(loss)`; `sync(loss)` at every printed line."""

    def __init__(self, tokens_per_step: int, n_devices: int, flops_per_token: float | None = None,
                 peak_tflops: float | None = None, clock=time.perf_counter):
        self.tokens_per_step, self.n_devices = tokens_per_step, n_devices
        self.flops_per_token, self.peak_tflops, self.clock = flops_per_token, peak_tflops, clock
        self.tokens = 0            # timed tokens, all devices
        self.seconds = 0.0
        self.compiled_steps = 0
        self._window_start, self._window_tokens, self._c0 = clock(), 0, compile_count()

    def before_step(self) -> None:
        self._c0 = compile_count()

    def after_step(self, loss) -> None:
        if compile_count() != self._c0:  # this step compiled: wait for it, start a new window after it
            self.compiled_steps += 1
            float(loss)
            self._window_start, self._window_tokens = self.clock(), 0
        else:
            self._window_tokens += self.tokens_per_step

    def sync(self, loss) -> None:
        """Wait for `loss` (the last step) and close the window."""
        float(loss)
        now = self.clock()
        if self._window_tokens:
            self.tokens += self._window_tokens
            self.seconds += now - self._window_start
        self._window_start, self._window_tokens = now, 0

    @property
    def tokens_per_s_per_device(self) -> float | None:
        return self.tokens / self.seconds / self.n_devices if self.tokens and self.seconds > 0 else None

    @property
    def mfu(self) -> float | None:
        tps = self.tokens_per_s_per_device
        if tps is None or not self.flops_per_token or not self.peak_tflops:
            return None
        return tps * self.flops_per_token / (self.peak_tflops * 1e12)


class WandbMonitor:
    def __init__(self, section):
        import wandb  # monitor_problems checked it is installed

        self.wandb = wandb
        wandb.init(project=section.project, group=section.group, entity=section.team)

    def write_events(self, events):
        for name, value, step in events:
            self.wandb.log({name: value}, step=step)

    def close(self):
        self.wandb.finish()


class Monitor:
    """All enabled monitors of a config; buffers device metrics until `flush()`.
    Every section is checked (`check_monitors`) before any backend starts."""

    def __init__(self, cfg, *, is_writer: bool = True):
        self.backends = []
        if is_writer:  # DeepSpeed writes from rank 0 only
            check_monitors(cfg)
            for attr, cls in (("csv_monitor", CSVMonitor), ("tensorboard", TensorBoardMonitor),
                              ("wandb", WandbMonitor)):
                section = getattr(cfg, attr, None)
                if section is not None and section.enabled:
                    self.backends.append(cls(section))
        self._pending: list[tuple[int, dict[str, Any]]] = []
        fp16 = getattr(cfg, "fp16", None)
        # DeepSpeed logs the loss scale only when fp16 is on.
        self._names = [k for k in EVENT_NAMES if k != "loss_scale" or (fp16 is not None and fp16.enabled)]

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    def record(self, global_samples: int, metrics: dict[str, Any]) -> None:
        if self.backends:
            self._pending.append((global_samples, {k: metrics[k] for k in self._names if k in metrics}))

    def record_method(self, global_samples: int, metrics: dict[str, Any]) -> None:
        """A method's own scalars (the keys with a "/": GRPO's reward/mean, policy/kl, DPO's
        rewards/chosen), logged as Train/Samples/<key> beside DeepSpeed's events, so that a run's
        reward curve is in the same CSV / TensorBoard folder as its loss."""
        if self.backends:
            method = {METHOD_PREFIX + k: v for k, v in metrics.items() if "/" in k and getattr(v, "ndim", 0) == 0}
            self._pending.append((global_samples, method))

    def flush(self) -> None:
        if not self._pending:
            return
        events = [(EVENT_NAMES.get(k, k), float(v), step) for step, m in self._pending for k, v in m.items()]
        self._pending.clear()
        for backend in self.backends:
            backend.write_events(events)

    def close(self) -> None:
        self.flush()
        for backend in self.backends:
            backend.close()
