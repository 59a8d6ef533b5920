"""The rehearsal: ``doctor --model CONFIG --lab "A100-80GB,RTX3090,RTX3090"`` rehearses a lab nobody here owns, one
rank at a time on this machine's device, or the hybrid layout's ranks all together on it (see docs/plan-your-lab.md).

A command, not part of the runtime: it may import the layers below it (``observe``, ``lab``, ``plan``, ...), and no
module of the runtime imports it. Rehearsal mode inside the strategy (the fake process group, the lab's devices) is
:mod:`lightning_hetero.lab.rehearsal`.
"""
