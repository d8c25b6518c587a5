"""Local model folders as files describe them: a name read from a file that points at another file
(a sharded index's `weight_map`) must stay inside the folder that holds it, or a downloaded folder
could make us read any path; a PEFT adapter folder is told from a model's. Imports nothing (no jax:
the commands check a folder before jax is imported)."""
from __future__ import annotations

import os


def file_in_folder(folder: str, name, listed_in: str) -> str:
    """`folder`/`name` where `name` (as `listed_in` gives it) is a relative path that stays inside
    `folder` (no absolute path, no `..` leaving it); else ValueError in one line naming both.
    Judged on the text, not on symbolic links: a Hugging Face cache's snapshot folder links every
    file to its blob store, and that is the folder's own doing, not the listing's."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{listed_in}: lists {name!r}, not a file name; entries are file names inside {folder}")
    normal = os.path.normpath(name)
    if os.path.isabs(name) or os.path.splitdrive(name)[0] or normal == ".." or normal.startswith(".." + os.sep):
        raise ValueError(f"{listed_in}: lists {name!r}, a path outside {folder}; entries must be file names inside "
                         f"the folder (a folder that names other paths is refused, not read)")
    return os.path.join(folder, normal)


def adapter_folder_base(path: str) -> str | None:
    """Where `path` is a PEFT adapter folder (adapter_config.json and no config.json), not a model:
    the base model its adapter_config.json names ("" where it names none); else None."""
    import json

    config = os.path.join(path, "adapter_config.json")
    if os.path.exists(os.path.join(path, "config.json")) or not os.path.isfile(config):
        return None
    try:
        with open(config) as f:
            base = json.load(f).get("base_model_name_or_path")
    except (ValueError, AttributeError, OSError):  # unreadable: still an adapter folder by its file's name
        base = None
    return base if isinstance(base, str) else ""


def model_folder_problem(path: str, adapter_fix) -> str | None:
    """What keeps `path` (--hf-checkpoint's value) from being a model folder, as one line naming the
    flag: not a folder, or a PEFT adapter folder (`adapter_fix(base)` says what to give instead;
    base: the one its adapter_config.json names, else "BASE_FOLDER"); None where it is a folder of
    neither kind (its reader names what it lacks)."""
    flag = f"--hf-checkpoint {path}"
    if not os.path.isdir(path):  # a mistyped path: say that, not what a folder would lack
        return (f"{flag}: " + ("a file, not a folder" if os.path.exists(path) else
                               f"no such folder ({os.path.abspath(path)})")
                + "; give the folder holding config.json and model.safetensors")
    base = adapter_folder_base(path)
    if base is None:
        return None
    return f"{flag}: a PEFT adapter folder (adapter_config.json), not a model; {adapter_fix(base or 'BASE_FOLDER')}"
