"""`tensor_parallel.partition_config`: DeepSpeed's AutoTP layer specs, checked at load."""
from __future__ import annotations

import re
from collections.abc import Mapping

# tensor_parallel.partition_config, as DeepSpeed's AutoTPConfig.from_dict reads it
# (deepspeed/module_inject/autotp_config.py): its keys, and each layer_specs entry's.
_AUTOTP_KEYS = ("layer_specs", "use_default_specs", "tp_size", "embedding_partition_dim", "lm_head_patterns",
                "strict_mode")
_LAYER_SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output")


def check_partition_config(pc, problems):
    """DeepSpeed's AutoTP `partition_config`: layer_specs [{patterns: [regex], partition_type:
    row | column | skip, ...}], use_default_specs (default true). zerojax matches the patterns
    against dotted parameter paths (`h.attn.c_attn.kernel`); `shape` (a sub-parameter view) is
    refused rather than ignored."""
    if pc is None:
        return
    where = "tensor_parallel.partition_config"
    for key in pc:
        if key not in _AUTOTP_KEYS:
            problems.append(f"{where}.{key}: not a partition_config key; known: {', '.join(_AUTOTP_KEYS)}")
    if not isinstance(pc.get("use_default_specs", True), bool):
        problems.append(f"{where}.use_default_specs = {pc['use_default_specs']!r}: expected true or false")
    specs = pc.get("layer_specs", [])
    if not isinstance(specs, (list, tuple)):
        problems.append(f"{where}.layer_specs: expected a list of {{patterns, partition_type}} entries")
        return
    for i, spec in enumerate(specs):
        at = f"{where}.layer_specs[{i}]"
        if not isinstance(spec, Mapping):
            problems.append(f"{at}: expected an object with patterns and partition_type")
            continue
        for key in spec:
            if key not in _LAYER_SPEC_KEYS:
                problems.append(f"{at}.{key}: not a layer_specs key; known: {', '.join(_LAYER_SPEC_KEYS)}")
        patterns = spec.get("patterns")
        if not isinstance(patterns, (list, tuple)) or not patterns or not all(isinstance(p, str) for p in patterns):
            problems.append(f"{at}.patterns: expected a non-empty list of regular expressions (strings)")
        else:
            for p in patterns:
                try:
                    re.compile(p)
                except re.error as e:
                    problems.append(f"{at}.patterns: {p!r} is not a regular expression ({e})")
        kind = spec.get("partition_type", "column")
        if not isinstance(kind, str) or kind.lower() not in ("row", "column", "skip"):
            problems.append(f"{at}.partition_type = {kind!r}: choose row, column or skip")
        dim = spec.get("partition_dim")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
            problems.append(f"{at}.partition_dim = {dim!r}: expected an integer axis of the parameter")
        if spec.get("shape") is not None:
            problems.append(f"{at}.shape: sub-parameter views are not supported; zerojax splits a parameter's "
                            "own axes, so give a fused axis (e.g. q/k/v) its own dimension in the model and "
                            "name it with partition_dim")
