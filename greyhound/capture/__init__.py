"""Capture of torch.distributed calls the C hook cannot see (gloo on CPU).

``sitecustomize.py`` is the startup hook the SPANK plugin puts on PYTHONPATH
(installed to ``<prefix>/lib/greyhound/python/``), and the capture's one import hook:
when the program imports torch.distributed it loads ``_greyhound_capture.py``, which
binds to the C hook and wraps the calls (the common case in C when
spank/capture/fastpath.c is built), and when it imports DistributedDataParallel,
``_greyhound_ddp.py``, which records its gradient buckets. All three run without the
greyhound package, in any Python that has torch.
"""
