"""Stream a completion from precast's Triton model over gRPC with tritonclient.

python examples/triton/client.py [HOST:GRPC_PORT]
"""

import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient

url = sys.argv[1] if len(sys.argv) > 1 else "localhost:8001"
client = grpcclient.InferenceServerClient(url)


def tensor(name, value, dtype, np_dtype):
    t = grpcclient.InferInput(name, [1, 1], dtype)  # [batch 1, 1]: tensorrtllm_backend's layout
    t.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
    return t


inputs = [
    tensor("text_input", b"The capital of Germany is", "BYTES", np.object_),
    tensor("max_tokens", 16, "INT32", np.int32),
    tensor("stream", True, "BOOL", bool),
    tensor("temperature", 0.0, "FP32", np.float32),
]
responses = queue.Queue()
client.start_stream(callback=lambda result, error: responses.put((result, error)))
client.async_stream_infer("precast", inputs, request_id="1", enable_empty_final_response=True)
try:
    while True:
        try:
            result, error = responses.get(timeout=120)
        except queue.Empty:
            sys.exit("error: no response from the server in 120 s")
        if error is not None:
            sys.exit(f"error: {error}")
        text = result.as_numpy("text_output")
        if text is not None:
            print(text[0][0].decode(), end="", flush=True)
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
finally:  # the stream's thread keeps the process alive until it is stopped, also when the loop raises
    client.stop_stream(cancel_requests=True)
print()
