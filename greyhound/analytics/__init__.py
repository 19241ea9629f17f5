"""Tracking analytics of GREYHOUND-DETECT: pure numpy functions, arrays in, arrays out.

- :mod:`.period`: the iteration period of a rank's call sequence (ACF), the online
  clock that locks onto it and numbers iterations, and the iteration times.
- :mod:`.bocd`: Bayesian online change-point detection on log iteration times.
- :mod:`.verify`: BOCD+V, a BOCD change point counts only if the level moved >= 10%
  (the compiled kernel where it is built, else its Python reference).
- :mod:`.baselines`: the paper's two baselines (sliding-window median, plain BOCD).
- :mod:`.changepoint`: the :class:`~.changepoint.Detector` protocol every method
  implements (``update``, ``feed``), what it reports, and the recent values it reads.
- :mod:`.intervals`: slow intervals (onset, recovery, severity) from change points.
- :mod:`.detect`: the whole pipeline as one call, as ``greyhound detect`` runs it.
- :mod:`.tracker`: one rank's online state for the node agent (ring records in,
  iteration times, change points, slow intervals, arrivals and call durations out).
- :mod:`.synthetic`: generators (they take the caller's ``rng``) of labelled series
  and call traces (op codes as the hook's ring, :data:`greyhound.ring.OP`).
- :mod:`.scenarios`: a wider labelled test set (generators of different character,
  tune / held-out splits, scoring) and call traces rendered from its series.
"""
