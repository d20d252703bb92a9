"""precast.runtime.tensorrt: the TensorRT network and its runner (docs/tensorrt.md).

ops.py        the op interface and the trace both backends record
numpy_ops.py  the ops evaluated eagerly in numpy, with TensorRT's layer semantics
trt_ops.py    the ops recorded as a strongly typed TensorRT network (tensorrt or tensorrt_rtx)
lowering.py   the decoder written once against the ops
runner.py     TensorRTRunner: executor batches as the network's padded slot steps (GPU plan or numpy)

Building rank0.plan from this network is the builder's part (builder/tensorrt/plan.py).
"""
