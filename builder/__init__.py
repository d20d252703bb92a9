"""precast.builder: checkpoints in, engine directories out."""

from precast.builder.spec import ModelSpec, RopeScaling

__all__ = ["ModelSpec", "RopeScaling"]
