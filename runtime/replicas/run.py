"""`precast serve ENGINE --replicas N`: start (or join) a Ray cluster, run the application until SIGTERM / SIGINT,
then let Ray drain and stop the replicas."""

from __future__ import annotations

import signal
import threading

import ray
from ray import serve

from precast.runtime.replicas.app import APP_NAME, ReplicaOptions, ScaleOptions, build_app


def run_replicas(
    options: ReplicaOptions,
    scale: ScaleOptions,
    host: str = "127.0.0.1",
    port: int = 8000,
    ray_address: str | None = None,
    log_level: str = "info",
) -> None:
    app = build_app(options, scale)  # checks the engine and the settings before Ray starts
    ray.init(address=ray_address, include_dashboard=False, logging_level=log_level.upper())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False, logging_config={"log_level": log_level.upper()})
        count = f"{scale.min_replicas}..{scale.max_replicas} (autoscaling)" if scale.max_replicas else str(scale.replicas)
        print(f"precast serve: {options.model_name} on http://{host}:{port}/v1 with {count} replicas behind Ray Serve", flush=True)
        print(f"precast serve: routing {scale.routing}; {options.num_threads} threads per replica; /replicas lists them", flush=True)
        stop.wait()
        print("precast serve: stopping (replicas drain their requests)", flush=True)
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        ray.shutdown()
