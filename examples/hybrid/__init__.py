"""The parts of the reference DP x PP training job (examples/gpt_hybrid.py).

One concept per module: ``config`` (the run's dataclasses), ``layout`` (the one object
that owns the DP x PP layout), ``launch`` (torchrun / srun environment), ``data``
(synthetic tokens), ``model`` (GPT stages), ``schedule`` (1F1B), ``checkpoint``,
``relayout`` (S3: ranks take other cells of the grid, stage state moved in memory),
``train`` (the step loop).
"""
