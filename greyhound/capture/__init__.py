"""Capture of torch.distributed calls the C hook cannot see (gloo on CPU).

``sitecustomize.py`` is the startup hook the SPANK plugin puts on PYTHONPATH
(installed to ``<prefix>/lib/greyhound/python/``); ``_greyhound_capture.py`` does the
wrapping. Both run without the greyhound package, in any Python that has torch.
"""
