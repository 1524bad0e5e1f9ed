"""StepFun models for mm (Step 3.7 VL), registered through the ``mm.models`` entry-point group."""

__version__ = "0.1.0"
