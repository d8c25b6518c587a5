"""Kept for test modules that still ask for a module-scoped compilation cache: the whole run has
one already (tests/conftest.py), so the fixture only yields."""


def module_cache(tmp_path_factory):
    yield
