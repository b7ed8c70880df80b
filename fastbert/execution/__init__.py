"""How a model's forward runs: decided once per mode and kept as data (the plan), then run many times.

- mode.py: what a plan is bound to (device, dtype, autocast, grad, training, the thread's backend scope, TF32)
- structure.py: the model as the fused executors read it (each layer's parts found once), the one check that it
  still computes what fastbert's modules compute, and the one rule for when it changed
- plan.py: each fused op bound to its backend's function, and the executors that take the mode, in order
- graphs.py, stack.py, loop.py: the executors (CUDA-graph replay, the CPU layer stack, one loop over the layers'
  tensors); module by module (fastbert.modeling's own forwards) takes every forward the others decline
- warmup.py: pay a model's first-request costs ahead of traffic
"""

from fastbert.execution.graphs import GRAPHS, CudaGraphs
from fastbert.execution.loop import LOOP
from fastbert.execution.plan import Inputs, Plan, Plans
from fastbert.execution.stack import STACK
from fastbert.execution.structure import Forwards
from fastbert.execution.warmup import warmup

EXECUTORS = (GRAPHS, STACK, LOOP)  # the order a plan tries them in; module by module after them

__all__ = ["EXECUTORS", "CudaGraphs", "Forwards", "Inputs", "Plan", "Plans", "warmup"]
