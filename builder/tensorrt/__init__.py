"""precast.builder.tensorrt: the TensorRT target's build step (docs/tensorrt.md).

plan.py       building rank0.plan and its report into an engine directory, from the network that
              runtime/tensorrt/lowering.py defines
"""
