"""precast's Triton Inference Server backend: a python-backend model and a model-repository writer."""
