"""greyhound's Python startup hook (installed as <prefix>/lib/greyhound/python/sitecustomize.py).

Python imports the first ``sitecustomize`` on sys.path at startup. The SPANK plugin
puts this directory first on PYTHONPATH in every task of a greyhound job, so this
module:

1. runs the ``sitecustomize`` it shadows, if there is one further down sys.path;
2. does nothing more unless GREYHOUND_RUN_DIR is set (the greyhound environment);
3. otherwise arranges for torch.distributed, whenever the program imports it, to be
   wrapped by ``_greyhound_capture.py`` (next to this file) so that gloo's
   collectives and p2p land in the hook's ring, and then for
   DistributedDataParallel, whenever the program imports it, to be patched by
   ``_greyhound_ddp.py`` so that its gradient buckets do too. torch itself is never
   imported here.

This is the capture's one import hook: a finder that notices the first import of
each module it waits for and runs what waits for it right after the module's own
code. It never raises and never prints: a Python without torch, an old torch or a
missing hook library leaves the program exactly as it was.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH_DISTRIBUTED = "torch.distributed"
_DDP_MODULE = "torch.nn.parallel.distributed"


def _chain() -> None:
    """Runs the sitecustomize this one shadows (Debian's, a venv's, a site's)."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _load(name: str):
    """The capture's module name (name.py next to this file), loaded once, as a
    top-level module."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, name + ".py"))
    assert spec is not None and spec.loader is not None  # a .py path always has its loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _run_quietly(then, module) -> None:
    try:
        then(module)
    except Exception:  # noqa: BLE001  (fail open: the program runs unrecorded)
        pass


class _Loader(importlib.abc.Loader):
    """Runs a module's own loader, then what waits for the module."""

    def __init__(self, loader, then) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _run_quietly(self._then, module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Notices the first import of each module waited for and hands it to _Loader;
    leaves sys.meta_path when it waits for nothing more."""

    def __init__(self) -> None:
        self.waiting: dict = {}     # module name -> then(module)

    def find_spec(self, fullname, path, target=None):
        then = self.waiting.pop(fullname, None)
        if then is None:
            return None
        if not self.waiting and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)   # (no longer waited for: not us again)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, then)
        return spec


_FINDER = _Finder()


def _when_imported(name: str, then) -> None:
    """Runs then(module) right after the module called name is imported; at once if
    it already is (or is being imported: then sees it half made)."""
    module = sys.modules.get(name)
    if module is not None:
        _run_quietly(then, module)
        return
    _FINDER.waiting[name] = then
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _capture_torch_distributed(dist) -> None:
    hook = _load("_greyhound_capture").patch(dist)
    if hook is not None:
        _when_imported(_DDP_MODULE,
                       lambda ddp_module: _load("_greyhound_ddp").patch(ddp_module, hook, dist))


def _install() -> None:
    if getattr(sys, "_greyhound_capture_installed", False):
        return  # two copies of this file on sys.path: one is enough
    sys._greyhound_capture_installed = True  # type: ignore[attr-defined]  # a flag every copy sees
    if not os.environ.get("GREYHOUND_RUN_DIR"):
        return
    _when_imported(_TORCH_DISTRIBUTED, _capture_torch_distributed)


try:
    _chain()
except Exception:  # noqa: BLE001  (someone else's sitecustomize failed: not ours to stop)
    pass
try:
    _install()
except Exception:  # noqa: BLE001
    pass
