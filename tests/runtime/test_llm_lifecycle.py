"""An LLM used the way vLLM users write it: created, used and let go, with no `with` and no shutdown()."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from precast.runtime import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_cache_memory=64 << 20)
print(llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0)).text)
stream = llm.stream("Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
next(stream)  # a request still generating when the interpreter exits
"""


def test_interpreter_exit_without_shutdown_is_clean_every_time(smollm2_bf16_engine):
    """The exit used to abort now and then ("terminate called without an active exception", status 134)."""
    for attempt in range(20):
        run = subprocess.run([sys.executable, "-c", SCRIPT, str(smollm2_bf16_engine)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (attempt, run.returncode, run.stderr[-2000:])
        assert run.stdout.strip() and "terminate" not in run.stderr


DROP = """
import gc, sys, threading, time, weakref
from precast.runtime import LLM, SamplingParams

def anon_mib():  # anonymous memory: the weights and KV pool the runner allocated, not mapped files
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

before = anon_mib()
llm = LLM(sys.argv[1], kv_cache_memory=64 << 20)
llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
held = anon_mib()
ref = weakref.ref(llm)
del llm
gc.collect()
time.sleep(0.2)
print(before, held, anon_mib(), ref() is None, sorted(t.name for t in threading.enumerate()))
"""


def test_a_dropped_llm_is_freed(smollm2_bf16_engine):
    run = subprocess.run([sys.executable, "-c", DROP, str(smollm2_bf16_engine)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    before, held, after, collected, threads = run.stdout.strip().rsplit("\n", 1)[-1].split(" ", 4)
    before, held, after = float(before), float(held), float(after)
    assert collected == "True" and threads == "['MainThread']"  # no dispatcher or executor thread left
    assert held - before > 200  # the bf16 weights (~270 MB) were resident ...
    assert after - before < (held - before) / 4, (before, held, after)  # ... and went back to the OS
