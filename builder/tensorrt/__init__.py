"""precast.builder.tensorrt: the TensorRT target (docs/tensorrt.md).

ops.py        the op interface and the trace both backends record
numpy_ops.py  the ops evaluated eagerly in numpy, with TensorRT's layer semantics
trt_ops.py    the ops recorded as a strongly typed TensorRT network (tensorrt or tensorrt_rtx)
lowering.py   the decoder written once against the ops
plan.py       building rank0.plan and its report into an engine directory
"""
