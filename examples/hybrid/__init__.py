"""The parts of the reference DP x PP training job (examples/gpt_hybrid.py).

One concept per module: ``config`` (the run's dataclasses), ``layout`` (the one object
that owns the DP x PP layout), ``launch`` (torchrun / srun environment), ``data``
(synthetic tokens), ``model`` (GPT stages), ``schedule`` (1F1B), ``checkpoint``,
``train`` (the step loop).
"""
