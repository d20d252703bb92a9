"""A real tritonserver (from the nvidia-pytriton wheel) serving precast's python-backend model,
queried with tritonclient over HTTP and gRPC."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from precast.runtime import SamplingParams
from precast.runtime.triton.repo import write_model_repository

pytestmark = pytest.mark.tritonserver  # every test here starts a real tritonserver

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of Germany is", "One, two, three,", "The sky is", "Water boils at"]


def triton_python() -> str:
    """The Python of the numpy<2 environment that runs tritonserver's stub (made by `make install-triton`)."""
    path = os.environ.get("PRECAST_TRITON_PYTHON", str(ROOT / ".venv-triton" / "bin" / "python"))
    if not Path(path).is_file():
        pytest.fail(f"no Triton environment at {path}: run `make install-triton` (or set PRECAST_TRITON_PYTHON)")
    return path


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_tritonserver(repo: Path) -> tuple[subprocess.Popen, dict[str, int], Path]:
    http, grpc, metrics = free_ports(3)
    log = repo.parent / f"{repo.name}.log"
    proc = subprocess.Popen(
        [
            triton_python(),
            "-m",
            "precast",
            "triton",
            str(repo),
            "--http-port",
            str(http),
            "--grpc-port",
            str(grpc),
            "--metrics-port",
            str(metrics),
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1).status_code == 200:
                return proc, {"http": http, "grpc": grpc, "metrics": metrics}, log
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"tritonserver did not become ready:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def triton(smollm2_bf16_engine, tmp_path_factory):
    """One server, two models: `precast` (decoupled, streaming) and `precast_sync` (one response per request)."""
    root = tmp_path_factory.mktemp("triton")
    repo = write_model_repository(smollm2_bf16_engine, root / "repo", "precast", decoupled=True, kv_cache_memory=256 << 20)
    # The non-decoupled model speculates (prompt lookup): its greedy output must be plain decoding's all the same.
    sync = write_model_repository(
        smollm2_bf16_engine, root / "sync", "precast_sync", decoupled=False, kv_cache_memory=256 << 20, speculative="ngram"
    )
    shutil.move(str(sync / "precast_sync"), str(repo / "precast_sync"))
    proc, ports, log = start_tritonserver(repo)
    yield ports
    stop(proc)


@pytest.fixture(scope="module")
def expected(smollm2_llm) -> dict[str, str]:
    outs = smollm2_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    return {p: o.text for p, o in zip(PROMPTS, outs)}


def text_inputs(module, prompt: str, max_tokens: int, **extra):
    def tensor(name: str, value, dtype: str, np_dtype):
        t = module.InferInput(name, [1, 1], dtype)  # [batch, 1], as tensorrtllm_backend's clients send
        t.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
        return t

    inputs = [tensor("text_input", prompt.encode(), "BYTES", np.object_), tensor("max_tokens", max_tokens, "INT32", np.int32)]
    for name, (value, dtype, np_dtype) in extra.items():
        inputs.append(tensor(name, value, dtype, np_dtype))
    return inputs


def metric(ports, name: str, label: str, model: str = "precast") -> float:
    """One model's value: both models of the test server export the same families."""
    for line in httpx.get(f"http://127.0.0.1:{ports['metrics']}/metrics").text.splitlines():
        if line.startswith(name + "{") and label in line and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {label} {model}")


def test_http_and_grpc_infer_match_llm_generate(triton, expected):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    h = httpclient.InferenceServerClient(f"127.0.0.1:{triton['http']}")
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{triton['grpc']}")
    for prompt in PROMPTS[:2]:
        r = h.infer("precast_sync", text_inputs(httpclient, prompt, 12), outputs=[httpclient.InferRequestedOutput("text_output")])
        assert r.as_numpy("text_output")[0][0].decode() == expected[prompt]
        r = g.infer("precast_sync", text_inputs(grpcclient, prompt, 12), outputs=[grpcclient.InferRequestedOutput("text_output")])
        assert r.as_numpy("text_output")[0][0].decode() == expected[prompt]


def test_token_level_inputs_and_outputs(triton, smollm2_llm):
    import tritonclient.http as httpclient

    ids = smollm2_llm.tokenizer.encode("The capital of Germany is")
    want = smollm2_llm.generate(ids, SamplingParams(temperature=0, max_tokens=6)).token_ids
    t_ids = httpclient.InferInput("input_ids", [1, len(ids)], "INT32")
    t_ids.set_data_from_numpy(np.array([ids], dtype=np.int32))
    t_len = httpclient.InferInput("request_output_len", [1, 1], "INT32")
    t_len.set_data_from_numpy(np.array([[6]], dtype=np.int32))
    r = httpclient.InferenceServerClient(f"127.0.0.1:{triton['http']}").infer("precast_sync", [t_ids, t_len])
    assert r.as_numpy("output_ids").tolist() == [[want]] and r.as_numpy("sequence_length").tolist() == [[6]]


def grpc_stream(ports, jobs: list[tuple[str, str, list]], cancel_after: int | None = None) -> dict[str, list]:
    """Run requests on one gRPC stream; returns request id -> list of text pieces (or errors)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for rid, model, inputs in jobs:
        client.async_stream_infer(
            model, inputs, request_id=rid, enable_empty_final_response=True, outputs=[grpcclient.InferRequestedOutput("text_output")]
        )
    pieces: dict[str, list] = {rid: [] for rid, _, _ in jobs}
    open_ids = set(pieces)
    received = 0
    deadline = time.time() + 120
    while open_ids and time.time() < deadline:
        result, error = results.get(timeout=60)
        if error is not None:
            raise AssertionError(f"stream error: {error}")
        response = result.get_response()
        rid = response.id
        out = result.as_numpy("text_output")
        if out is not None:
            pieces[rid].append(out[0][0].decode())
            received += 1
        if response.parameters["triton_final_response"].bool_param:
            open_ids.discard(rid)
        if cancel_after is not None and received >= cancel_after:
            client.stop_stream(cancel_requests=True)
            return pieces
    client.stop_stream()
    assert not open_ids
    return pieces


def test_decoupled_grpc_streams_16_concurrent(triton, expected, smollm2_llm):
    import tritonclient.grpc as grpcclient

    prompts = [f"{i}, {i + 1}, {i + 2}," for i in range(16)]
    want = smollm2_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    jobs = [(str(i), "precast", text_inputs(grpcclient, p, 10, stream=(True, "BOOL", bool))) for i, p in enumerate(prompts)]
    pieces = grpc_stream(triton, jobs)
    for i, w in enumerate(want):
        assert len(w.token_ids) == 10  # counting continues: every stream has tokens to send
        assert "".join(pieces[str(i)]) == w.text
        assert len(pieces[str(i)]) > 1  # really streamed
    # stream=false on the decoupled model: one response holding the whole text.
    single = grpc_stream(triton, [("x", "precast", text_inputs(grpcclient, PROMPTS[0], 12, stream=(False, "BOOL", bool)))])
    assert single["x"] == [expected[PROMPTS[0]]]


def test_http_generate_endpoints(triton, expected):
    base = f"http://127.0.0.1:{triton['http']}/v2/models/precast"
    r = httpx.post(f"{base}/generate", json={"text_input": PROMPTS[0], "max_tokens": 12}, timeout=60)
    assert r.status_code == 200 and r.json()["text_output"] == expected[PROMPTS[0]]
    with httpx.stream(
        "POST", f"{base}/generate_stream", json={"text_input": PROMPTS[1], "max_tokens": 12, "stream": True}, timeout=60
    ) as s:
        import json as _json

        chunks = [_json.loads(line[6:])["text_output"] for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(chunks) == expected[PROMPTS[1]] and len(chunks) > 1


def test_cancelling_a_stream_frees_blocks(triton):
    import tritonclient.grpc as grpcclient

    tokens_before = metric(triton, "precast_token_metrics", 'token_type="output"')
    jobs = [
        (
            "long",
            "precast",
            text_inputs(grpcclient, "1, 2, 3, 4,", 1500, stream=(True, "BOOL", bool), exclude_input_in_output=(True, "BOOL", bool)),
        )
    ]
    pieces = grpc_stream(triton, jobs, cancel_after=5)
    assert len(pieces["long"]) >= 5

    def generated() -> float:
        return metric(triton, "precast_token_metrics", 'token_type="output"') - tokens_before

    def idle() -> bool:
        return (
            metric(triton, "precast_kv_cache_block_metrics", 'kv_cache_block_type="used"') == 0
            and metric(triton, "precast_request_metrics", 'request_type="active"') == 0
        )

    # The model publishes metrics every 0.2 s, and 5 tokens can come and go between two snapshots: wait until a
    # snapshot has counted this request's tokens and shows nothing running. Generous for a loaded machine; what
    # proves the cancellation is the token count below (1500 tokens take ~20 s on an idle machine).
    deadline = time.time() + 30
    while time.time() < deadline and not (generated() >= 5 and idle()):
        time.sleep(0.25)
    assert generated() >= 5 and idle()
    generated_when_idle = generated()
    time.sleep(0.5)
    # The request really stopped: far fewer than 1500 tokens, and no more are coming.
    assert 5 <= generated_when_idle < 1000
    assert generated() == generated_when_idle


def test_stop_request_ends_a_stream(triton):
    """tensorrtllm_backend's protocol: a request with the same id and stop=true ends the first one."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{triton['grpc']}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(
        "precast",
        text_inputs(grpcclient, "1, 2, 3, 4,", 1500, stream=(True, "BOOL", bool)),
        request_id="s1",
        enable_empty_final_response=True,
    )
    pieces, finals, sent_stop = 0, 0, False
    deadline = time.time() + 30
    while finals < 2 and time.time() < deadline:  # the stop request's final and the generation's final
        result, error = results.get(timeout=30)
        assert error is None, error
        response = result.get_response()
        if result.as_numpy("text_output") is not None:
            pieces += 1
        finals += response.parameters["triton_final_response"].bool_param
        if pieces >= 3 and not sent_stop:
            client.async_stream_infer(
                "precast", text_inputs(grpcclient, "", 1, stop=(True, "BOOL", bool)), request_id="s1", enable_empty_final_response=True
            )
            sent_stop = True
    client.stop_stream()
    assert finals == 2 and pieces < 200  # ended long before its 1500 tokens


@pytest.mark.parametrize(
    "body,message",
    [
        ({"max_tokens": 5}, "text_input (text) or input_ids"),
        ({"text_input": "hi", "temperature": -1.0}, "temperature"),
        ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
        ({"text_input": "hi " * 3000, "max_tokens": 5}, "max_seq_len"),
    ],
)
def test_bad_inputs_return_errors_and_server_keeps_serving(triton, expected, body, message):
    url = f"http://127.0.0.1:{triton['http']}/v2/models/precast_sync/generate"
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code >= 400 and message in r.json()["error"]
    ok = httpx.post(url, json={"text_input": PROMPTS[0], "max_tokens": 12}, timeout=60)
    assert ok.json()["text_output"] == expected[PROMPTS[0]]


def test_custom_metrics_move(triton):
    import tritonclient.http as httpclient

    def sync_metric(name: str, label: str) -> float:
        return metric(triton, name, label, model="precast_sync")

    before = sync_metric("precast_general_metrics", 'general_type="iteration_counter"')
    out_before = sync_metric("precast_token_metrics", 'token_type="output"')
    httpclient.InferenceServerClient(f"127.0.0.1:{triton['http']}").infer("precast_sync", text_inputs(httpclient, "Hello", 5))
    deadline = time.time() + 5  # metrics refresh every 0.2 s
    while time.time() < deadline and sync_metric("precast_token_metrics", 'token_type="output"') == out_before:
        time.sleep(0.1)
    assert sync_metric("precast_general_metrics", 'general_type="iteration_counter"') > before
    assert sync_metric("precast_token_metrics", 'token_type="output"') > out_before
    for label in ('kv_cache_block_type="max"', 'kv_cache_block_type="free"', 'kv_cache_block_type="tokens_per"'):
        assert sync_metric("precast_kv_cache_block_metrics", label) > 0


def test_triton_example_runs(smollm2_bf16_engine, tmp_path):
    env = dict(os.environ, PRECAST_TRITON_PYTHON=triton_python(), ENGINE=str(smollm2_bf16_engine), WORKDIR=str(tmp_path))
    # Its own session, killed as a group on timeout: subprocess.run's timeout kills bash only and then waits for
    # the pipes its children (tritonserver, the client) still hold.
    script = subprocess.Popen(
        ["bash", str(ROOT / "examples" / "triton" / "run.sh")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = script.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(script.pid, signal.SIGKILL)
        out, err = script.communicate()
        pytest.fail(f"examples/triton/run.sh ran past 600 s: {out[-2000:]} {err[-2000:]}")
    assert script.returncode == 0, out[-2000:] + err[-2000:]
    assert "Berlin" in out


def trtllm_inputs(module, prompt: str, max_tokens: int, stream: bool, **extra):
    """What a client written for tensorrtllm_backend's ensemble sends: [1, 1] tensors (string lists [1, n])."""
    values = {
        "text_input": ([prompt.encode()], "BYTES", np.object_),
        "max_tokens": ([max_tokens], "INT32", np.int32),
        "stream": ([stream], "BOOL", bool),
        "pad_id": ([2], "INT32", np.int32),
        "end_id": ([2], "INT32", np.int32),
        "beam_width": ([1], "INT32", np.int32),
        "num_return_sequences": ([1], "INT32", np.int32),
        "temperature": ([0.0], "FP32", np.float32),
        "top_k": ([1], "INT32", np.int32),
        "top_p": ([1.0], "FP32", np.float32),
        "random_seed": ([7], "UINT64", np.uint64),
        "min_length": ([1], "INT32", np.int32),
        "length_penalty": ([1.0], "FP32", np.float32),
        "return_log_probs": ([True], "BOOL", bool),
        "exclude_input_in_output": ([True], "BOOL", bool),
    } | extra
    tensors = []
    for name, (value, dtype, np_dtype) in values.items():
        t = module.InferInput(name, [1, len(value)], dtype)
        t.set_data_from_numpy(np.array([value], dtype=np_dtype))
        tensors.append(t)
    return tensors


TRTLLM_OUTPUTS = ("text_output", "cum_log_probs", "output_log_probs", "batch_index", "sequence_index",
                  "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")  # fmt: skip


def test_a_tensorrtllm_backend_client_works_unchanged(triton, smollm2_llm):
    import tritonclient.grpc as grpcclient

    want = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, logprobs=0, stop_token_ids=[2]))
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{triton['grpc']}")
    outputs = [grpcclient.InferRequestedOutput(n) for n in TRTLLM_OUTPUTS]
    r = client.infer("precast_sync", trtllm_inputs(grpcclient, PROMPTS[0], 8, False), outputs=outputs)
    assert r.as_numpy("text_output").shape == (1, 1) and r.as_numpy("text_output")[0][0].decode() == want.text
    assert r.as_numpy("output_log_probs").shape == (1, 1, 8)
    np.testing.assert_allclose(r.as_numpy("output_log_probs")[0][0], want.logprobs, atol=1e-5)
    np.testing.assert_allclose(r.as_numpy("cum_log_probs")[0][0], sum(want.logprobs), atol=1e-4)
    assert r.as_numpy("batch_index").tolist() == [[0]] and r.as_numpy("sequence_index").tolist() == [[0]]
    drafted, accepted = r.as_numpy("total_draft_tokens")[0][0], r.as_numpy("total_accepted_draft_tokens")[0][0]
    assert 0 <= accepted <= drafted
    assert r.as_numpy("acceptance_rate")[0][0] == pytest.approx(accepted / drafted if drafted else 0.0)

    # the same over a decoupled gRPC stream, with stop words, bad words, a JSON schema and an embedding bias
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    extra = {
        "stop_words": ([b"\n\n"], "BYTES", np.object_),
        "bad_words": ([b"Munich"], "BYTES", np.object_),
        "guided_decoding_guide_type": ([b"json_schema"], "BYTES", np.object_),
        "guided_decoding_guide": ([json.dumps(schema).encode()], "BYTES", np.object_),
        "embedding_bias_words": ([b" Paris"], "BYTES", np.object_),
        "embedding_bias_weights": ([-5.0], "FP32", np.float32),
    }
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(
        "precast",
        trtllm_inputs(grpcclient, PROMPTS[0], 40, True, **extra),
        request_id="t",
        enable_empty_final_response=True,
        outputs=outputs,
    )
    text, final = "", False
    while not final:
        result, error = results.get(timeout=60)
        assert error is None, error
        if result.as_numpy("text_output") is not None:
            text += result.as_numpy("text_output")[0][0].decode()
            assert result.as_numpy("batch_index").tolist() == [[0]]
        final = result.get_response().parameters["triton_final_response"].bool_param
    client.stop_stream()
    assert "city" in json.loads(text)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"beam_width": ([2], "INT32", np.int32)}, "beam_width=2 is not supported"),
        ({"num_return_sequences": ([3], "INT32", np.int32)}, "num_return_sequences=3"),
        ({"lora_task_id": ([1], "UINT64", np.uint64)}, "LoRA"),
        ({"return_context_logits": ([True], "BOOL", bool)}, "return_context_logits=true"),
        ({"guided_decoding_guide_type": ([b"xml"], "BYTES", np.object_)}, "guided_decoding_guide_type 'xml'"),
        ({"embedding_bias_words": ([b"a", b"b"], "BYTES", np.object_)}, "embedding_bias_weights"),
    ],
)
def test_what_precast_cannot_honour_is_refused_per_request(triton, extra, message):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{triton['grpc']}")
    with pytest.raises(InferenceServerException, match=message):
        client.infer("precast_sync", trtllm_inputs(grpcclient, PROMPTS[0], 4, False, **extra))
    two = grpcclient.InferInput("text_input", [2, 1], "BYTES")
    two.set_data_from_numpy(np.array([[b"a"], [b"b"]], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="one prompt per request"):
        client.infer("precast_sync", [two])
    assert client.infer("precast_sync", trtllm_inputs(grpcclient, PROMPTS[0], 2, False)).as_numpy("text_output") is not None


def test_tensorrtllm_backend_metric_families(triton):
    import tritonclient.http as httpclient

    httpclient.InferenceServerClient(f"127.0.0.1:{triton['http']}").infer("precast_sync", text_inputs(httpclient, "Hello", 3))
    time.sleep(0.5)  # metrics refresh every 0.2 s
    text = httpx.get(f"http://127.0.0.1:{triton['metrics']}/metrics").text
    for family, label in (
        ("nv_trt_llm_request_metrics", 'request_type="max"'),
        ("nv_trt_llm_kv_cache_block_metrics", 'kv_cache_block_type="max"'),
        ("nv_trt_llm_inflight_batcher_metrics", 'inflight_batcher_specific_metric="generation_requests"'),
        ("nv_trt_llm_general_metrics", 'general_type="iteration_counter"'),
    ):
        assert metric(triton, family, label, model="precast_sync") >= 0
        assert f"{family}{{" in text and 'version="1"' in text
    assert metric(triton, "nv_trt_llm_request_metrics", 'request_type="max"', model="precast_sync") == 64
    assert metric(triton, "nv_trt_llm_general_metrics", 'general_type="iteration_counter"', model="precast_sync") > 0
