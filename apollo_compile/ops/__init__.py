"""Every custom op apollo registers (``torch.ops.apollo.*``) lives in this package, one module per op.

Importing the package registers them all; ``apollo_compile/__init__.py`` imports it, so any graph
that names one of these ops compiles, runs and loads (an Inductor cache entry included) once
apollo_compile is imported. Adding an op: a module here, and one import line below.
"""

from . import mm_into  # noqa: F401  apollo::mm_into, a matmul written into a given buffer
from . import fused_update  # noqa: F401  apollo::adam_step and adam_step_foreach, the optimizer's update in a step
