"""greyhound's Python startup hook (installed as <prefix>/lib/greyhound/python/sitecustomize.py).

Python imports the first ``sitecustomize`` on sys.path at startup. The SPANK plugin
puts this directory first on PYTHONPATH in every task of a greyhound job, so this
module:

1. runs the ``sitecustomize`` it shadows, if there is one further down sys.path;
2. does nothing more unless GREYHOUND_RUN_DIR is set (the greyhound environment);
3. otherwise arranges for torch.distributed, whenever the program imports it, to be
   wrapped by ``_greyhound_capture.py`` (next to this file) so that gloo's
   collectives and p2p land in the hook's ring. torch itself is never imported here.

It never raises and never prints: a Python without torch, an old torch or a missing
hook library leaves the program exactly as it was.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TARGET = "torch.distributed"


def _chain() -> None:
    """Runs the sitecustomize this one shadows (Debian's, a venv's, a site's)."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _load_capture():
    path = os.path.join(_HERE, "_greyhound_capture.py")
    spec = importlib.util.spec_from_file_location("_greyhound_capture", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules["_greyhound_capture"] = module
    spec.loader.exec_module(module)
    return module


def _patch(dist) -> None:
    try:
        capture = sys.modules.get("_greyhound_capture") or _load_capture()
        if capture is not None:
            capture.patch(dist)
    except Exception:  # noqa: BLE001  (fail open: the program runs unrecorded)
        pass


class _Loader(importlib.abc.Loader):
    """Runs torch.distributed's own loader, then wraps its calls."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _patch(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Notices the import of torch.distributed (once) and hands it to _Loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def _install() -> None:
    if getattr(sys, "_greyhound_capture_installed", False):
        return  # two copies of this file on sys.path: one is enough
    sys._greyhound_capture_installed = True
    if not os.environ.get("GREYHOUND_RUN_DIR"):
        return
    if _TARGET in sys.modules:
        _patch(sys.modules[_TARGET])
    else:
        sys.meta_path.insert(0, _Finder())


try:
    _chain()
except Exception:  # noqa: BLE001  (someone else's sitecustomize failed: not ours to stop)
    pass
try:
    _install()
except Exception:  # noqa: BLE001
    pass
