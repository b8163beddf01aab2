"""Started by every Python process whose PYTHONPATH holds this folder (``tests.conftest.
jax_cache_env``: the ranks, kernels and commands that tests start with a shared JAX cache).

When the process imports ``jax._src.compiler``, ``tests/compile_once.py`` is installed in it:
processes that share a persistent compilation cache compile each program once between them
instead of once each. Nothing else changes, and a process that never imports JAX pays only for
this file. The folder holds nothing else, so adding it to PYTHONPATH adds no other module.
"""

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "jax._src.compiler"
_COMPILE_ONCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "compile_once.py")


class _AfterImport(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        spec = importlib.util.spec_from_file_location("_compile_once_child", _COMPILE_ONCE)
        compile_once = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(compile_once)
        compile_once.install(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterImport(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
