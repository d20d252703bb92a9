"""precast.builder: checkpoints in, engine directories out."""

from precast.engine.spec import ModelSpec, RopeScaling

__all__ = ["ModelSpec", "RopeScaling"]
