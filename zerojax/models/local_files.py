"""Names read from a file that point at other files (a sharded index's `weight_map`): each must
stay inside the folder that holds the file, or a downloaded folder could make us read any path.
Imports nothing of zerojax."""
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
